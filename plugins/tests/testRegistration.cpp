/*
 * dflash2_trt — the ways libdflash2_plugins.so reaches a TensorRT plugin registry, checked against a fake
 * libnvinfer (libdflash2_fake_nvinfer.so: registry + version) loaded globally first, as an application
 * linked against TensorRT would have it.
 *
 *   testRegistration <fake_nvinfer.so> <libdflash2_plugins.so> <mode>
 *
 *   loadLibrary  IPluginRegistry::loadLibrary (trtexec --dynamicPlugins, the Python and C runtimes): the
 *                registry dlopens the library, which registers nothing by itself (no re-entrant registry
 *                call), then takes the 1 creator from getCreators; a second loadLibrary fails (duplicate)
 *   init         the application dlopens the library (nothing registered) and calls dfl2PluginsInit(registry)
 *                (and once more with nullptr: found via dlsym): 1 creator; getCreators then lists 0, so a
 *                following loadLibrary registers no duplicate
 *   static       $DFLASH2_PLUGINS_STATIC_REGISTRATION=1 (the opt-in): registered when dlopen'ed
 *   major        the fake reports another major ($DFLASH2_FAKE_NVINFER_VERSION): loadLibrary and init both
 *                register nothing, without calling into the host's registry or logger
 */
#include <NvInferRuntime.h>

#include "dfl2Test.h"

#include <cstdio>
#include <cstring>
#include <dlfcn.h>

using dfl2Test::symbol;

int main(int argc, char** argv)
{
    if (argc != 4)
    {
        std::fprintf(stderr, "usage: %s <fake_nvinfer.so> <libdflash2_plugins.so> <loadLibrary|init|static|major>\n",
            argv[0]);
        return 2;
    }
    char const* mode = argv[3];
    void* fake = dlopen(argv[1], RTLD_NOW | RTLD_GLOBAL);
    if (fake == nullptr)
    {
        std::fprintf(stderr, "dlopen failed: %s\n", dlerror());
        return 1;
    }
    auto count = symbol<int32_t (*)()>(fake, "fakeRegistryCount");
    auto name = symbol<char const* (*) (int32_t)>(fake, "fakeRegistryName");
    auto reentrant = symbol<int32_t (*)()>(fake, "fakeRegistryReentrantCalls");
    auto getRegistry = symbol<nvinfer1::IPluginRegistry* (*) ()>(fake, "getPluginRegistry");
    if (!count || !name || !reentrant || !getRegistry)
    {
        std::fprintf(stderr, "the fake libnvinfer lacks its symbols\n");
        return 1;
    }
    nvinfer1::IPluginRegistry& registry = *getRegistry();
    bool const loadPath = std::strcmp(mode, "loadLibrary") == 0 || std::strcmp(mode, "major") == 0;
    void* plugins = nullptr;
    if (loadPath)
    {
        void* handle = registry.loadLibrary(argv[2]);
        CHECK((handle != nullptr) == (std::strcmp(mode, "loadLibrary") == 0));
        plugins = dlopen(argv[2], RTLD_NOW | RTLD_NOLOAD); // the registry's copy (also after a refusal)
    }
    else
    {
        plugins = dlopen(argv[2], RTLD_NOW | RTLD_LOCAL);
    }
    if (plugins == nullptr)
    {
        std::fprintf(stderr, "dlopen failed: %s\n", dlerror());
        return 1;
    }
    auto registered = symbol<int32_t (*)()>(plugins, "dfl2PluginsStaticallyRegistered");
    auto init = symbol<int32_t (*)(nvinfer1::IPluginRegistry*)>(plugins, "dfl2PluginsInit");
    auto getCreators = symbol<nvinfer1::IPluginCreatorInterface* const* (*) (int32_t&)>(plugins, "getCreators");
    if (!registered || !init || !getCreators)
    {
        std::fprintf(stderr, "libdflash2_plugins.so lacks its entry points\n");
        return 1;
    }
    CHECK(reentrant() == 0); // nothing called the registry from inside its own loadLibrary
    int32_t nb = -1;
    if (std::strcmp(mode, "loadLibrary") == 0)
    {
        CHECK(count() == 1 && std::strcmp(name(0), "DFlash2PathSelector") == 0 && registered() == 0);
        CHECK(registry.loadLibrary(argv[2]) == nullptr && count() == 1); // already registered: refused, no dup
        getCreators(nb);
        CHECK(nb == 1);
    }
    else if (std::strcmp(mode, "init") == 0)
    {
        CHECK(count() == 0 && registered() == 0); // loading alone registers nothing
        CHECK(init(&registry) == 1 && count() == 1 && registered() == 1);
        CHECK(init(nullptr) == 1 && count() == 1); // idempotent; nullptr = the process's registry
        getCreators(nb);
        CHECK(nb == 0);
        CHECK(registry.loadLibrary(argv[2]) == nullptr && count() == 1 && reentrant() == 0);
    }
    else if (std::strcmp(mode, "static") == 0)
    {
        CHECK(count() == 1 && std::strcmp(name(0), "DFlash2PathSelector") == 0 && registered() == 1);
        getCreators(nb);
        CHECK(nb == 0);
    }
    else if (std::strcmp(mode, "major") == 0)
    {
        CHECK(count() == 0 && registered() == 0);
        CHECK(init(&registry) == 0 && count() == 0);
        CHECK(getCreators(nb) == nullptr && nb == 0);
    }
    else
    {
        std::fprintf(stderr, "unknown mode %s\n", mode);
        return 2;
    }
    std::printf("testRegistration %s: registry has %d creator(s), registered by the library %d, getCreators %d\n",
        mode, count(), registered(), nb);
    return dfl2TestReport("testRegistration");
}
