/*
 * dflash2_trt — a stand-in for libnvinfer's plugin registry (tests only).
 *
 * Exports getPluginRegistry / getInferLibVersion like libnvinfer does, so testStaticRegistration
 * can check the load-time registration of libdflash2_plugins.so without TensorRT. Only the V3
 * creator calls the plugin library makes are implemented; everything else fails loudly.
 */
#include <NvInferRuntime.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
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

    bool registerCreator(nvinfer1::IPluginCreatorInterface& creator, char const* const ns) noexcept override
    {
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
    PluginLibraryHandle loadLibrary(char const*) noexcept override
    {
        unsupported();
        return nullptr;
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

//! 10.14.1, or $DFLASH2_FAKE_NVINFER_VERSION (e.g. 110400: a TensorRT 11 host for the major check)
extern "C" __attribute__((visibility("default"))) int32_t getInferLibVersion() noexcept
{
    char const* env = std::getenv("DFLASH2_FAKE_NVINFER_VERSION");
    return env != nullptr ? static_cast<int32_t>(std::strtol(env, nullptr, 10)) : 101401;
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
