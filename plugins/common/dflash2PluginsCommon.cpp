/*
 * dflash2_trt — library entry points of libdflash2_plugins.so, logging, static registration.
 *
 * The library never links libnvinfer: TensorRT objects are only reached through the virtual
 * interfaces TensorRT hands over (creators, ILoggerFinder/ILogger, the registry given to
 * dfl2PluginsInit) or, for the opt-in load-time registration, through getPluginRegistry looked up
 * with dlsym.
 */
#include "dflash2PluginsCommon.h"

#include "../pathSelector/dflash2PathSelectorPlugin.h"

#include <NvInferVersion.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <dlfcn.h>
#include <mutex>
#include <string>

// One source, built per TensorRT header major: the IPluginV3 / ILoggerFinder / IPluginRegistry
// interfaces this library implements or calls are virtual-table contracts of one major version
// (TensorRT 11 reordered them), so a build for major N may only be used by a TensorRT of major N.
#if NV_TENSORRT_MAJOR != 10 && NV_TENSORRT_MAJOR != 11
#error "libdflash2_plugins supports the TensorRT 10.x and 11.x headers only"
#endif

namespace dflash2
{
namespace plugin
{
namespace
{

constexpr int32_t kBUILT_MAJOR = NV_TENSORRT_MAJOR;

//! getInferLibVersion of the TensorRT in this process (major * 10000 + minor * 100 + patch), or 0
//! when none is loaded: a globally visible libnvinfer (linked application, trtexec), else a
//! libnvinfer.so.N already loaded locally (the tensorrt Python module) found with RTLD_NOLOAD.
//! Never loads TensorRT itself.
int32_t runtimeVersion() noexcept
{
    void* sym = dlsym(RTLD_DEFAULT, "getInferLibVersion");
    for (char const* soname : {"libnvinfer.so.11", "libnvinfer.so.10"})
    {
        if (sym != nullptr)
        {
            break;
        }
        if (void* handle = dlopen(soname, RTLD_NOW | RTLD_NOLOAD))
        {
            sym = dlsym(handle, "getInferLibVersion");
            dlclose(handle); // RTLD_NOLOAD took a reference: give it back
        }
    }
    if (sym == nullptr)
    {
        return 0;
    }
    using VersionFn = int32_t (*)();
    VersionFn getVersion{};
    std::memcpy(&getVersion, &sym, sizeof(getVersion)); // a cast from void* is not portable C++
    return getVersion();
}

//! True when the TensorRT in this process (if any) has the major version this library was built
//! for. On a mismatch prints one line on stderr, once (TensorRT's logger is not used: reaching it
//! goes through the very virtual tables that differ).
bool runtimeMajorMatches() noexcept
{
    static int32_t const sVersion = runtimeVersion();
    int32_t const major = sVersion / 10000;
    if (sVersion == 0 || major == kBUILT_MAJOR)
    {
        return true;
    }
    static std::atomic<bool> sReported{false};
    if (!sReported.exchange(true))
    {
        std::fprintf(stderr,
            "[dflash2_plugins] ERROR: this libdflash2_plugins.so was built against TensorRT %d headers but TensorRT "
            "%d.%d is loaded; rebuild it against TensorRT %d headers (cmake -DTensorRT_ROOT=<TensorRT %d>)\n",
            kBUILT_MAJOR, major, (sVersion / 100) % 100, major, major);
    }
    return false;
}

std::mutex gLoggerMutex;
nvinfer1::ILoggerFinder* gLoggerFinder{nullptr}; // guarded by gLoggerMutex
thread_local std::string tLastError;
std::atomic<bool> gStaticallyRegistered{false};

nvinfer1::ILogger* findLogger() noexcept
{
    std::lock_guard<std::mutex> lock(gLoggerMutex);
    return gLoggerFinder != nullptr ? gLoggerFinder->findLogger() : nullptr;
}

//! The creators, created on first use (function-local statics avoid static-init-order issues
//! with the registrar below).
PathSelectorCreator& pathSelectorCreator() noexcept
{
    static PathSelectorCreator sCreator;
    return sCreator;
}

nvinfer1::IPluginCreatorInterface* const* creatorList() noexcept
{
    static nvinfer1::IPluginCreatorInterface* const sList[] = {&pathSelectorCreator()};
    return sList;
}

constexpr int32_t kNB_CREATORS = 1;

//! Registers the creators into `registry` unless a creator of the same name/version/namespace is already
//! there (another copy of this library got there first: theirs is kept). True when ours are registered.
bool registerInto(nvinfer1::IPluginRegistry& registry) noexcept
{
    try
    {
        bool all = true;
        for (int32_t k = 0; k < kNB_CREATORS; ++k)
        {
            auto* creator = static_cast<nvinfer1::IPluginCreatorV3One*>(creatorList()[k]);
            if (registry.getCreator(creator->getPluginName(), creator->getPluginVersion(),
                    creator->getPluginNamespace())
                != nullptr)
            {
                all = false;
                continue;
            }
            all = registry.registerCreator(*creator, creator->getPluginNamespace()) && all;
        }
        return all;
    }
    catch (...)
    {
        return false;
    }
}

//! The registry of a TensorRT that is loaded and globally visible in this process (an application linked
//! against libnvinfer, trtexec), found with dlsym; nullptr when there is none or it is of another major.
nvinfer1::IPluginRegistry* processRegistry() noexcept
{
    void* versionSym = dlsym(RTLD_DEFAULT, "getInferLibVersion");
    void* registrySym = dlsym(RTLD_DEFAULT, "getPluginRegistry");
    if (versionSym == nullptr || registrySym == nullptr || !runtimeMajorMatches())
    {
        return nullptr; // another major's registry has another virtual table
    }
    using RegistryFn = nvinfer1::IPluginRegistry* (*) ();
    RegistryFn getRegistry{};
    std::memcpy(&getRegistry, &registrySym, sizeof(getRegistry)); // a cast from void* is not portable C++
    return getRegistry();
}

#ifndef DFLASH2_PLUGINS_STATIC_REGISTRATION_DEFAULT
#define DFLASH2_PLUGINS_STATIC_REGISTRATION_DEFAULT 0
#endif

//! Load-time registration, opt-in: the build option DFLASH2_PLUGINS_STATIC_REGISTRATION (default OFF) or
//! $DFLASH2_PLUGINS_STATIC_REGISTRATION=1 (=0 turns a build's default off). Off by default because
//! IPluginRegistry::loadLibrary (trtexec --dynamicPlugins, the Python and C runtimes) dlopens this library
//! from inside the registry: registering from a load-time initializer then re-enters the registry, and
//! getCreators would report 0 creators to the loadLibrary in progress. Applications linked against TensorRT
//! call dfl2PluginsInit instead. Never loads TensorRT itself.
struct StaticRegistrar
{
    StaticRegistrar() noexcept
    {
        char const* env = std::getenv("DFLASH2_PLUGINS_STATIC_REGISTRATION");
        bool const on = env != nullptr ? std::strcmp(env, "1") == 0 : DFLASH2_PLUGINS_STATIC_REGISTRATION_DEFAULT != 0;
        if (!on)
        {
            return;
        }
        if (nvinfer1::IPluginRegistry* registry = processRegistry())
        {
            gStaticallyRegistered.store(registerInto(*registry));
        }
    }
};

StaticRegistrar const gStaticRegistrar;

} // namespace

void setLoggerFinder(nvinfer1::ILoggerFinder* finder) noexcept
{
    if (!runtimeMajorMatches()) // its findLogger() slot is not where this build expects it
    {
        return;
    }
    std::lock_guard<std::mutex> lock(gLoggerMutex);
    if (gLoggerFinder == nullptr && finder != nullptr)
    {
        gLoggerFinder = finder;
    }
}

void logError(char const* message) noexcept
{
    try
    {
        tLastError = message != nullptr ? message : "";
    }
    catch (...)
    {
        // keep going: logging must not fail
    }
    if (nvinfer1::ILogger* logger = findLogger())
    {
        logger->log(nvinfer1::ILogger::Severity::kERROR, message);
    }
    else
    {
        std::fprintf(stderr, "[dflash2_plugins] ERROR: %s\n", message != nullptr ? message : "");
    }
}

void logVerbose(char const* message) noexcept
{
    if (nvinfer1::ILogger* logger = findLogger())
    {
        logger->log(nvinfer1::ILogger::Severity::kVERBOSE, message);
    }
}

char const* lastError() noexcept
{
    return tLastError.c_str();
}

} // namespace plugin
} // namespace dflash2

extern "C" void setLoggerFinder(nvinfer1::ILoggerFinder* finder) noexcept
{
    dflash2::plugin::setLoggerFinder(finder);
}

extern "C" nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators) noexcept
{
    if (!dflash2::plugin::runtimeMajorMatches())
    {
        nbCreators = 0; // loadLibrary then fails: the host gets nullptr / None and our stderr line
        return nullptr;
    }
    nbCreators = dflash2::plugin::gStaticallyRegistered.load() ? 0 : dflash2::plugin::kNB_CREATORS;
    return dflash2::plugin::creatorList();
}

extern "C" int32_t dfl2PluginsTensorRTMajor() noexcept
{
    return dflash2::plugin::kBUILT_MAJOR;
}

extern "C" nvinfer1::IPluginCreatorInterface* const* dfl2PluginsAllCreators(int32_t* nbCreators) noexcept
{
    if (nbCreators != nullptr)
    {
        *nbCreators = dflash2::plugin::kNB_CREATORS;
    }
    return dflash2::plugin::creatorList();
}

extern "C" int32_t dfl2PluginsInit(nvinfer1::IPluginRegistry* registry) noexcept
{
    if (!dflash2::plugin::runtimeMajorMatches())
    {
        return 0;
    }
    if (registry == nullptr)
    {
        registry = dflash2::plugin::processRegistry();
    }
    if (registry == nullptr)
    {
        return 0;
    }
    if (dflash2::plugin::gStaticallyRegistered.load())
    {
        return 1;
    }
    bool const ok = dflash2::plugin::registerInto(*registry);
    dflash2::plugin::gStaticallyRegistered.store(ok);
    return ok ? 1 : 0;
}

extern "C" int32_t dfl2PluginsStaticallyRegistered() noexcept
{
    return dflash2::plugin::gStaticallyRegistered.load() ? 1 : 0;
}

extern "C" char const* dfl2PluginsLastError() noexcept
{
    return dflash2::plugin::lastError();
}
