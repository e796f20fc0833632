/*
 * dflash2_trt — library entry points of libdflash2_plugins.so, logging, static registration.
 *
 * The library never links libnvinfer: TensorRT objects are only reached through the virtual
 * interfaces TensorRT hands over (creators, ILoggerFinder/ILogger) or, for the static
 * registration, through getPluginRegistry looked up with dlsym at load time.
 */
#include "dflash2PluginsCommon.h"

#include "../pathSelector/dflash2PathSelectorPlugin.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <dlfcn.h>
#include <mutex>
#include <string>

namespace dflash2
{
namespace plugin
{
namespace
{

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

//! Load-time registration into the registry of a TensorRT that is already loaded and globally
//! visible (an application linked against libnvinfer, or trtexec). It never loads TensorRT
//! itself and does nothing when TensorRT is absent or older than 10 (the IPluginV3 registry
//! API); set DFLASH2_PLUGINS_STATIC_REGISTRATION=0 to switch it off.
struct StaticRegistrar
{
    StaticRegistrar() noexcept
    {
        try
        {
            char const* env = std::getenv("DFLASH2_PLUGINS_STATIC_REGISTRATION");
            if (env != nullptr && std::strcmp(env, "0") == 0)
            {
                return;
            }
            void* versionSym = dlsym(RTLD_DEFAULT, "getInferLibVersion");
            void* registrySym = dlsym(RTLD_DEFAULT, "getPluginRegistry");
            if (versionSym == nullptr || registrySym == nullptr)
            {
                return;
            }
            // function pointers from dlsym: copy the bits (a cast from void* is not portable C++)
            using VersionFn = int32_t (*)();
            using RegistryFn = nvinfer1::IPluginRegistry* (*)();
            VersionFn getVersion{};
            RegistryFn getRegistry{};
            std::memcpy(&getVersion, &versionSym, sizeof(getVersion));
            std::memcpy(&getRegistry, &registrySym, sizeof(getRegistry));
            if (getVersion() < 100000) // TensorRT 10.0 is encoded 100000
            {
                return;
            }
            nvinfer1::IPluginRegistry* registry = getRegistry();
            if (registry == nullptr)
            {
                return;
            }
            bool all = true;
            for (int32_t k = 0; k < kNB_CREATORS; ++k)
            {
                auto* creator = static_cast<nvinfer1::IPluginCreatorV3One*>(creatorList()[k]);
                if (registry->getCreator(creator->getPluginName(), creator->getPluginVersion(),
                        creator->getPluginNamespace())
                    != nullptr)
                {
                    all = false; // another copy of this library got there first; keep theirs
                    continue;
                }
                all = registry->registerCreator(*creator, creator->getPluginNamespace()) && all;
            }
            gStaticallyRegistered.store(all);
        }
        catch (...)
        {
            gStaticallyRegistered.store(false);
        }
    }
};

StaticRegistrar const gStaticRegistrar;

} // namespace

void setLoggerFinder(nvinfer1::ILoggerFinder* finder) noexcept
{
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
    nbCreators = dflash2::plugin::gStaticallyRegistered.load() ? 0 : dflash2::plugin::kNB_CREATORS;
    return dflash2::plugin::creatorList();
}

extern "C" nvinfer1::IPluginCreatorInterface* const* dfl2PluginsAllCreators(int32_t* nbCreators) noexcept
{
    if (nbCreators != nullptr)
    {
        *nbCreators = dflash2::plugin::kNB_CREATORS;
    }
    return dflash2::plugin::creatorList();
}

extern "C" int32_t dfl2PluginsStaticallyRegistered() noexcept
{
    return dflash2::plugin::gStaticallyRegistered.load() ? 1 : 0;
}

extern "C" char const* dfl2PluginsLastError() noexcept
{
    return dflash2::plugin::lastError();
}
