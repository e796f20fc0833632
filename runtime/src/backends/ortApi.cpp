//! \file ortApi.cpp
//! Finding and opening libonnxruntime; see ortApi.h.
#include "ortApi.h"

#include <dlfcn.h>
#include <glob.h>

#include <cstdlib>
#include <mutex>

namespace dflash2
{

namespace
{

std::string envOr(char const* name)
{
    char const* v = std::getenv(name);
    return v != nullptr ? std::string(v) : std::string();
}

//! The files matching a glob pattern, sorted (newest version name last).
std::vector<std::string> globFiles(std::string const& pattern)
{
    std::vector<std::string> out;
    glob_t g{};
    if (::glob(pattern.c_str(), 0, nullptr, &g) == 0)
    {
        for (size_t i = 0; i < g.gl_pathc; ++i)
        {
            out.emplace_back(g.gl_pathv[i]);
        }
    }
    ::globfree(&g);
    return out;
}

//! The wheel's copies in the active virtual environment, newest name last (glob sorts).
std::vector<std::string> wheelCopies()
{
    std::string const venv = envOr("VIRTUAL_ENV");
    if (venv.empty())
    {
        return {};
    }
    return globFiles(venv + "/lib/python3*/site-packages/onnxruntime/capi/libonnxruntime.so.1*");
}

//! The folder of the file this code was loaded from: libdflash2.so (or the program a static libdflash2 is linked
//! into); "" when the loader cannot say.
std::string ownFolder()
{
    Dl_info info{};
    if (::dladdr(reinterpret_cast<void*>(&ownFolder), &info) == 0 || info.dli_fname == nullptr)
    {
        return {};
    }
    std::string const self(info.dli_fname);
    auto const slash = self.rfind('/');
    return slash == std::string::npos ? std::string() : self.substr(0, slash);
}

//! The onnxruntime wheel's copies in the site-packages that holds this libdflash2: `pip install` puts the library in
//! site-packages/dflash2_trt/lib/, the wheel's ONNX Runtime in site-packages/onnxruntime/capi/.
std::vector<std::string> besideCopies()
{
    std::string const dir = ownFolder();
    return dir.empty() ? std::vector<std::string>{}
                       : globFiles(dir + "/../../onnxruntime/capi/libonnxruntime.so.1*");
}

//! dlopen + OrtGetApiBase + GetApi(ORT_API_VERSION); refusals name the file and the reason.
OrtLibrary openAt(std::string const& file, std::string const& how)
{
    void* handle = ::dlopen(file.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr)
    {
        char const* e = ::dlerror();
        throw Error(DFL2_ERR_UNAVAILABLE,
            "ONNX Runtime (" + how + "): cannot open " + file + ": " + (e != nullptr ? e : "unknown error"));
    }
    using GetApiBase = OrtApiBase const* (*) ();
    auto const getBase = reinterpret_cast<GetApiBase>(::dlsym(handle, "OrtGetApiBase"));
    OrtApiBase const* base = getBase != nullptr ? getBase() : nullptr;
    if (base == nullptr)
    {
        ::dlclose(handle);
        throw Error(DFL2_ERR_UNAVAILABLE, "ONNX Runtime (" + how + "): " + file + " has no OrtGetApiBase: not an ONNX "
            "Runtime library");
    }
    OrtLibrary lib;
    lib.version = base->GetVersionString != nullptr ? base->GetVersionString() : "unknown";
    lib.api = base->GetApi(ORT_API_VERSION);
    if (lib.api == nullptr)
    {
        ::dlclose(handle);
        throw Error(DFL2_ERR_UNAVAILABLE, "ONNX Runtime " + lib.version + " (" + how + ", " + file
            + ") does not provide C API version " + std::to_string(ORT_API_VERSION)
            + ", the version of the headers this libdflash2 was built with: use ONNX Runtime 1."
            + std::to_string(ORT_API_VERSION) + " or newer");
    }
    Dl_info info{};
    lib.path = ::dladdr(reinterpret_cast<void*>(getBase), &info) != 0 && info.dli_fname != nullptr
        ? std::string(info.dli_fname)
        : file;
    lib.how = how;
    return lib;  // the handle stays open for the process
}

OrtLibrary findLibrary(std::string const& optionPath)
{
    if (!optionPath.empty())
    {
        return openAt(optionPath, "option ort_library");
    }
    std::string const env = envOr("ORT_LIBRARY");
    if (!env.empty())
    {
        return openAt(env, "$ORT_LIBRARY");
    }
    std::string tried = "libonnxruntime.so.1 (";
    try
    {
        return openAt("libonnxruntime.so.1", "the system's libonnxruntime.so.1");
    }
    catch (Error const& e)
    {
        char const* m = e.what();
        tried += std::string(m).substr(std::string(m).rfind(": ") + 2) + ")";
    }
    std::vector<std::string> const wheel = wheelCopies();
    if (!wheel.empty())
    {
        return openAt(wheel.back(), "the onnxruntime wheel in $VIRTUAL_ENV");
    }
    tried += envOr("VIRTUAL_ENV").empty() ? ", no $VIRTUAL_ENV with the onnxruntime wheel"
                                          : ", no onnxruntime wheel in $VIRTUAL_ENV=" + envOr("VIRTUAL_ENV");
    std::vector<std::string> const beside = besideCopies();
    if (!beside.empty())
    {
        return openAt(beside.back(), "the onnxruntime wheel beside libdflash2");
    }
    tried += ", no onnxruntime wheel beside libdflash2 (" + ownFolder() + "/../../onnxruntime/capi)";
    throw Error(DFL2_ERR_UNAVAILABLE, "ONNX Runtime not found (tried " + tried + "): pip install onnxruntime in "
        "the active virtual environment, install libonnxruntime.so.1, or name the library with $ORT_LIBRARY or the "
        "ort_library option");
}

} // namespace

OrtLibrary const& openOrtLibrary(std::string const& optionPath)
{
    // one library per process (two ONNX Runtimes in one process would not share their thread pools and statics); a
    // later request for another path is refused rather than mixed
    static std::mutex mutex;
    static OrtLibrary opened;
    std::lock_guard<std::mutex> lock(mutex);
    if (opened.api == nullptr)
    {
        opened = findLibrary(optionPath);
    }
    else if (!optionPath.empty() && optionPath != opened.path)
    {
        OrtLibrary const other = findLibrary(optionPath);
        if (other.path != opened.path)
        {
            throw Error(DFL2_ERR_UNAVAILABLE, "ONNX Runtime is already open from " + opened.path + " in this process; "
                "option ort_library names another: " + optionPath);
        }
    }
    return opened;
}

void ortCheck(OrtApi const* api, OrtStatus* status, std::string const& what)
{
    if (status == nullptr)
    {
        return;
    }
    std::string const message = api->GetErrorMessage(status);
    api->ReleaseStatus(status);
    throw Error(DFL2_ERR_BACKEND, what + ": " + message.substr(0, 600));
}

OrtTensor::OrtTensor(OrtApi const* api, void* data, size_t bytes, std::vector<int64_t> const& shape,
    ONNXTensorElementDataType type)
    : mApi(api)
{
    // one CPU memory description for every tensor (ORT's CPU allocator info; never released)
    static OrtMemoryInfo* cpu = [api] {
        OrtMemoryInfo* info = nullptr;
        ortCheck(api, api->CreateCpuMemoryInfo(OrtArenaAllocator, OrtMemTypeDefault, &info), "CreateCpuMemoryInfo");
        return info;
    }();
    ortCheck(api, api->CreateTensorWithDataAsOrtValue(cpu, data, bytes, shape.data(), shape.size(), type, &mValue),
        "CreateTensorWithDataAsOrtValue");
}

OrtTensor::~OrtTensor()
{
    if (mValue != nullptr)
    {
        mApi->ReleaseValue(mValue);
    }
}

OrtTensor::OrtTensor(OrtTensor&& other) noexcept
    : mApi(other.mApi)
    , mValue(other.mValue)
{
    other.mValue = nullptr;
}

OrtTensor& OrtTensor::operator=(OrtTensor&& other) noexcept
{
    if (this != &other)
    {
        if (mValue != nullptr)
        {
            mApi->ReleaseValue(mValue);
        }
        mApi = other.mApi;
        mValue = other.mValue;
        other.mValue = nullptr;
    }
    return *this;
}

} // namespace dflash2
