/*
 * dflash2_trt — a stand-in for libnvinfer (tests only): its plugin registry and version entry points.
 *
 * Exports getPluginRegistry / getInferLibVersion / getInferLibBuildVersion / createInferRuntime_INTERNAL
 * like libnvinfer does, for two kinds of test without TensorRT:
 *   - plugins/tests/testStaticRegistration: the two ways libdflash2_plugins.so reaches a registry —
 *     IPluginRegistry::loadLibrary (dlopen + getCreators, as trtexec --dynamicPlugins and the runtimes do)
 *     and the exported dfl2PluginsInit (an application linked against TensorRT);
 *   - runtime (tests/test_capi.py): built as libnvinfer.so.<major>, the library the C API's TensorRT backend
 *     opens, to check which library it opens and which versions it refuses.
 * $DFLASH2_FAKE_NVINFER_VERSION (e.g. 110400: a TensorRT 11 host) and $DFLASH2_FAKE_NVINFER_BUILD set the
 * reported version; createInferRuntime_INTERNAL returns null (there is no runtime here). Only the V3 creator
 * calls of the plugin library and loadLibrary are implemented; everything else fails loudly.
 */
#include <NvInferRuntime.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <dlfcn.h>
#include <string>
#include <vector>

// A registry must implement the deprecated IPluginCreator (V2) methods of the interface too.
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"

namespace
{

class FakeRegistry : public nvinfer1::IPluginRegistry
{
public:
    struct Entry
    {
        nvinfer1::IPluginCreatorInterface* creator;
        std::string ns;
    };
    std::vector<Entry> entries;
    bool inLoad{false};      //!< inside loadLibrary's dlopen (the plugin library's constructors run)
    int32_t reentrant{0};    //!< registry calls made from there (TensorRT's registry is not re-entrant)

    bool registerCreator(nvinfer1::IPluginCreatorInterface& creator, char const* const ns) noexcept override
    {
        reentrant += inLoad ? 1 : 0;
        if (getCreator(name(creator), version(creator), ns) != nullptr)
        {
            return false;
        }
        entries.push_back({&creator, ns != nullptr ? ns : ""});
        return true;
    }
    nvinfer1::IPluginCreatorInterface* getCreator(
        char const* const pluginName, char const* const pluginVersion, char const* const ns) noexcept override
    {
        for (Entry const& e : entries)
        {
            if (std::strcmp(name(*e.creator), pluginName) == 0 && std::strcmp(version(*e.creator), pluginVersion) == 0
                && e.ns == (ns != nullptr ? ns : ""))
            {
                return e.creator;
            }
        }
        return nullptr;
    }
    nvinfer1::IPluginCreatorInterface* const* getAllCreators(int32_t* const n) const noexcept override
    {
        *n = 0;
        return nullptr;
    }
    bool deregisterCreator(nvinfer1::IPluginCreatorInterface const&) noexcept override
    {
        return unsupported();
    }
    bool registerCreator(nvinfer1::IPluginCreator&, char const* const) noexcept override
    {
        return unsupported();
    }
    nvinfer1::IPluginCreator* const* getPluginCreatorList(int32_t* const) const noexcept override
    {
        unsupported();
        return nullptr;
    }
    nvinfer1::IPluginCreator* getPluginCreator(char const* const, char const* const, char const* const) noexcept override
    {
        unsupported();
        return nullptr;
    }
    void setErrorRecorder(nvinfer1::IErrorRecorder* const) noexcept override {}
    nvinfer1::IErrorRecorder* getErrorRecorder() const noexcept override
    {
        return nullptr;
    }
    bool deregisterCreator(nvinfer1::IPluginCreator const&) noexcept override
    {
        return unsupported();
    }
    bool isParentSearchEnabled() const override
    {
        return false;
    }
    void setParentSearchEnabled(bool const) override {}
    //! As TensorRT: dlopen, then getCreators; fails (nullptr) when the library lists no creator or any of them is
    //! already registered.
    PluginLibraryHandle loadLibrary(char const* path) noexcept override
    {
        inLoad = true;
        void* handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
        inLoad = false;
        if (handle == nullptr)
        {
            return nullptr;
        }
        void* sym = dlsym(handle, "getCreators");
        using GetCreators = nvinfer1::IPluginCreatorInterface* const* (*) (int32_t&);
        GetCreators getCreators{};
        std::memcpy(&getCreators, &sym, sizeof(getCreators));
        int32_t n = 0;
        nvinfer1::IPluginCreatorInterface* const* list = getCreators != nullptr ? getCreators(n) : nullptr;
        if (list == nullptr || n <= 0)
        {
            return nullptr;
        }
        for (int32_t i = 0; i < n; ++i)
        {
            auto& c = static_cast<nvinfer1::IPluginCreatorV3One&>(*list[i]);
            if (!registerCreator(*list[i], c.getPluginNamespace()))
            {
                return nullptr;
            }
        }
        return handle;
    }
    void deregisterLibrary(PluginLibraryHandle) noexcept override
    {
        unsupported();
    }
    nvinfer1::IPluginResource* acquirePluginResource(char const*, nvinfer1::IPluginResource*) noexcept override
    {
        unsupported();
        return nullptr;
    }
    int32_t releasePluginResource(char const*) noexcept override
    {
        return unsupported() ? 0 : -1;
    }
    nvinfer1::IPluginCreatorInterface* const* getAllCreatorsRecursive(int32_t* const n) noexcept override
    {
        *n = 0;
        return nullptr;
    }

private:
    static char const* name(nvinfer1::IPluginCreatorInterface& c)
    {
        return static_cast<nvinfer1::IPluginCreatorV3One&>(c).getPluginName();
    }
    static char const* version(nvinfer1::IPluginCreatorInterface& c)
    {
        return static_cast<nvinfer1::IPluginCreatorV3One&>(c).getPluginVersion();
    }
    static bool unsupported() noexcept
    {
        std::fprintf(stderr, "fake registry: unexpected call\n");
        std::abort();
    }
};

FakeRegistry& registry()
{
    static FakeRegistry sRegistry;
    return sRegistry;
}

} // namespace

extern "C" __attribute__((visibility("default"))) nvinfer1::IPluginRegistry* getPluginRegistry() noexcept
{
    return &registry();
}

//! The headers' version, or $DFLASH2_FAKE_NVINFER_VERSION (e.g. 110400: a TensorRT 11 host for the major check)
extern "C" __attribute__((visibility("default"))) int32_t getInferLibVersion() noexcept
{
    char const* env = std::getenv("DFLASH2_FAKE_NVINFER_VERSION");
    return env != nullptr ? static_cast<int32_t>(std::strtol(env, nullptr, 10)) : static_cast<int32_t>(NV_TENSORRT_VERSION);
}

//! The headers' build number, or $DFLASH2_FAKE_NVINFER_BUILD
extern "C" __attribute__((visibility("default"))) int32_t getInferLibBuildVersion() noexcept
{
    char const* env = std::getenv("DFLASH2_FAKE_NVINFER_BUILD");
    return env != nullptr ? static_cast<int32_t>(std::strtol(env, nullptr, 10)) : NV_TENSORRT_BUILD;
}

//! No runtime here: a caller that got past the version checks sees "TensorRT refused to create a runtime".
extern "C" __attribute__((visibility("default"))) void* createInferRuntime_INTERNAL(void*, int32_t) noexcept
{
    return nullptr;
}

//! Registry calls made while loadLibrary's dlopen ran (re-entrant; must stay 0).
extern "C" __attribute__((visibility("default"))) int32_t fakeRegistryReentrantCalls() noexcept
{
    return registry().reentrant;
}

//! Number of creators registered so far, and the name of entry k (tests).
extern "C" __attribute__((visibility("default"))) int32_t fakeRegistryCount() noexcept
{
    return static_cast<int32_t>(registry().entries.size());
}

extern "C" __attribute__((visibility("default"))) char const* fakeRegistryName(int32_t k) noexcept
{
    return static_cast<nvinfer1::IPluginCreatorV3One*>(registry().entries.at(static_cast<size_t>(k)).creator)
        ->getPluginName();
}
