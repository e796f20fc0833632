/*
 * dflash2_trt — load-time (static) registration of libdflash2_plugins.so, checked against a fake
 * libnvinfer registry (libdflash2_fake_nvinfer.so) loaded globally first, as an application
 * linked against TensorRT would have it.
 *
 *   testStaticRegistration <fake_nvinfer.so> <libdflash2_plugins.so> <expect: 1 registered | 0 off |
 *                          major: another TensorRT major>
 * With expect = 1 the creator must be in the registry and getCreators must report 0 creators
 * (so IPluginRegistry::loadLibrary does not register a duplicate); with expect = 0 (run with
 * DFLASH2_PLUGINS_STATIC_REGISTRATION=0) nothing is registered and getCreators lists 1 creator;
 * with expect = major (the fake reports another major via DFLASH2_FAKE_NVINFER_VERSION) nothing
 * is registered and getCreators returns no creators (loadLibrary fails), without calling into the
 * host's registry or logger.
 */
#include <NvInferRuntime.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <dlfcn.h>

template <typename Fn>
Fn symbol(void* handle, char const* name)
{
    void* sym = dlsym(handle, name);
    Fn fn{};
    if (sym != nullptr)
    {
        std::memcpy(&fn, &sym, sizeof(fn));
    }
    return fn;
}

int main(int argc, char** argv)
{
    if (argc != 4)
    {
        std::fprintf(stderr, "usage: %s <fake_nvinfer.so> <libdflash2_plugins.so> <0|1|major>\n", argv[0]);
        return 2;
    }
    bool const expectRegistered = std::strcmp(argv[3], "1") == 0;
    bool const expectMismatch = std::strcmp(argv[3], "major") == 0;
    void* fake = dlopen(argv[1], RTLD_NOW | RTLD_GLOBAL);
    void* plugins = fake != nullptr ? dlopen(argv[2], RTLD_NOW | RTLD_LOCAL) : nullptr;
    if (plugins == nullptr)
    {
        std::fprintf(stderr, "dlopen failed: %s\n", dlerror());
        return 1;
    }
    auto count = symbol<int32_t (*)()>(fake, "fakeRegistryCount");
    auto name = symbol<char const* (*) (int32_t)>(fake, "fakeRegistryName");
    auto registered = symbol<int32_t (*)()>(plugins, "dfl2PluginsStaticallyRegistered");
    auto getCreators = symbol<nvinfer1::IPluginCreatorInterface* const* (*) (int32_t&)>(plugins, "getCreators");
    if (!count || !name || !registered || !getCreators)
    {
        std::fprintf(stderr, "missing symbols\n");
        return 1;
    }
    int32_t nb = -1;
    auto* const list = getCreators(nb);
    bool ok = true;
    if (expectMismatch)
    {
        ok = count() == 0 && registered() == 0 && nb == 0 && list == nullptr;
    }
    else if (expectRegistered)
    {
        ok = count() == 1 && std::strcmp(name(0), "DFlash2PathSelector") == 0 && registered() == 1 && nb == 0;
    }
    else
    {
        ok = count() == 0 && registered() == 0 && nb == 1;
    }
    // a second load of the same file is the same library: no second registration
    void* again = dlopen(argv[2], RTLD_NOW | RTLD_LOCAL);
    ok = ok && again == plugins && count() == (expectRegistered ? 1 : 0);
    std::printf("testStaticRegistration: registry has %d creator(s), statically registered %d, getCreators %d: %s\n",
        count(), registered(), nb, ok ? "ok" : "FAILED");
    return ok ? 0 : 1;
}
