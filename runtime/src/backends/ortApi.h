//! \file ortApi.h
//! ONNX Runtime opened at run time: which libonnxruntime the backend takes (and why), its C API table checked against
//! the headers' ORT_API_VERSION, and small RAII helpers over OrtStatus / OrtValue. Nothing links libonnxruntime: a
//! libdflash2 built with this backend loads and runs (callbacks, TensorRT) on a machine without it, and
//! dfl2_model_load says in one status why ONNX Runtime cannot be used.
//!
//! Which library (the first that opens): the "ort_library" option; $ORT_LIBRARY; the system's libonnxruntime.so.1
//! (the loader's search: LD_LIBRARY_PATH, ldconfig's cache); the onnxruntime wheel's copy in the active virtual
//! environment ($VIRTUAL_ENV/lib/python3.*/site-packages/onnxruntime/capi/libonnxruntime.so.1.*); the onnxruntime
//! wheel's copy in the site-packages that holds this libdflash2 (a pip-installed libdflash2 lies in
//! site-packages/dflash2_trt/lib/: ../../onnxruntime/capi/libonnxruntime.so.1.* from its folder), which a C program
//! linked against the installed package finds without an activated environment. The library found first is the one
//! taken: a named path that does not open is refused, not skipped.
#pragma once

#include "core/decoder.h"

#include <onnxruntime_c_api.h>

#include <cstdint>
#include <string>
#include <vector>

namespace dflash2
{

//! An opened libonnxruntime (process lifetime: never dlclose'd, ORT keeps threads and statics).
struct OrtLibrary
{
    OrtApi const* api{nullptr};
    std::string path;     //!< the file opened
    std::string how;      //!< which rule found it ("option ort_library", "$ORT_LIBRARY", ...)
    std::string version;  //!< GetVersionString(), e.g. "1.32.0"
};

//! The ONNX Runtime to use (see the file comment); DFL2_ERR_UNAVAILABLE with the reason when none opens, it has no
//! OrtGetApiBase, or it does not provide ORT_API_VERSION.
OrtLibrary const& openOrtLibrary(std::string const& optionPath);

//! Throws DFL2_ERR_BACKEND "<what>: <ORT's message>" when status is non-null (and releases it).
void ortCheck(OrtApi const* api, OrtStatus* status, std::string const& what);

//! A CPU tensor over caller memory (no copy; the memory must outlive every use of the value).
class OrtTensor
{
public:
    OrtTensor() = default;
    OrtTensor(OrtApi const* api, void* data, size_t bytes, std::vector<int64_t> const& shape,
        ONNXTensorElementDataType type);
    ~OrtTensor();
    OrtTensor(OrtTensor&& other) noexcept;
    OrtTensor& operator=(OrtTensor&& other) noexcept;
    OrtTensor(OrtTensor const&) = delete;
    OrtTensor& operator=(OrtTensor const&) = delete;

    OrtValue* get() const
    {
        return mValue;
    }

private:
    OrtApi const* mApi{nullptr};
    OrtValue* mValue{nullptr};
};

} // namespace dflash2
