/*
 * dflash2_trt — shared plumbing of libdflash2_plugins.so: logging and the exported C entry points.
 *
 * Logging goes to the ILogger TensorRT hands over through setLoggerFinder(); without one (e.g. a
 * test that dlopens the library with no TensorRT present) errors go to stderr. The last error
 * message of the calling thread is kept for dfl2PluginsLastError() so tests can check wording.
 */
#ifndef DFLASH2_PLUGINS_COMMON_H
#define DFLASH2_PLUGINS_COMMON_H

#include <NvInferRuntime.h>

#include <cstdint>

#if defined(_WIN32)
#define DFL2_PLUGIN_API __declspec(dllexport)
#else
#define DFL2_PLUGIN_API __attribute__((visibility("default")))
#endif

namespace dflash2
{
namespace plugin
{

//! Remember TensorRT's logger finder (thread-safe; the first non-null finder wins).
void setLoggerFinder(nvinfer1::ILoggerFinder* finder) noexcept;

//! Log an error (TensorRT logger, else stderr) and record it as this thread's last error.
void logError(char const* message) noexcept;

//! Log at verbose severity (TensorRT logger only; silent without one).
void logVerbose(char const* message) noexcept;

//! This thread's last error message ("" if none).
char const* lastError() noexcept;

} // namespace plugin
} // namespace dflash2

extern "C"
{
    //! TensorRT entry point: logger finder for the library (IPluginRegistry::loadLibrary, trtexec).
    DFL2_PLUGIN_API void setLoggerFinder(nvinfer1::ILoggerFinder* finder) noexcept;

    //! TensorRT entry point: the creators of this library. Reports 0 creators when dfl2PluginsInit or
    //! the opt-in load-time registration already put them into the process's registry, so a following
    //! IPluginRegistry::loadLibrary() does not register a duplicate (see pathSelector/README.md).
    DFL2_PLUGIN_API nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators) noexcept;

    //! The creators regardless of static registration (tests, tools). Never null.
    DFL2_PLUGIN_API nvinfer1::IPluginCreatorInterface* const* dfl2PluginsAllCreators(int32_t* nbCreators) noexcept;

    //! The TensorRT major version of the headers this library was built against (10 or 11). A
    //! TensorRT of another major loading it gets no creators and one line on stderr.
    DFL2_PLUGIN_API int32_t dfl2PluginsTensorRTMajor() noexcept;

    //! Registers the creators into `registry` (nullptr: the registry of the TensorRT this process is linked
    //! against, found with dlsym) — the load path of applications that link libnvinfer and this library
    //! (or dlopen it themselves) instead of calling IPluginRegistry::loadLibrary. Idempotent; afterwards
    //! getCreators reports 0 creators, so a later loadLibrary does not register a duplicate. Returns 1 when
    //! the creators are registered, 0 when not (no TensorRT, another major, or another copy's creator is
    //! already there).
    DFL2_PLUGIN_API int32_t dfl2PluginsInit(nvinfer1::IPluginRegistry* registry) noexcept;
    //! 1 if dfl2PluginsInit or the opt-in load-time registration registered the creators, else 0.
    DFL2_PLUGIN_API int32_t dfl2PluginsStaticallyRegistered() noexcept;

    //! The calling thread's last error message ("" if none); valid until the next error.
    DFL2_PLUGIN_API char const* dfl2PluginsLastError() noexcept;
}

#endif // DFLASH2_PLUGINS_COMMON_H
