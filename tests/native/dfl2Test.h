/* dflash2_trt — the one header of the C and C++ test programs (plugins/tests, runtime/tests).
 *
 *   CHECK(cond)            count a failure and print file:line and the condition; keeps going
 *   CHECK_MSG(cond, ...)   the same with a printf-style explanation
 *   dfl2TestFailures()     the failures counted so far in this program
 *   dfl2TestReport(name)   prints "<name>: N check(s) failed" or "<name>: ok"; returns the exit status (0 / 1)
 *   CUDA_OK(call)          a CUDA runtime call that must succeed, else print it and exit(1) (only where
 *                          cuda_runtime_api.h is included before this header)
 *   dfl2TestSymbol(h, name)       dlsym as a void* (C); dfl2Test::symbol<Fn>(h, name) as a function pointer
 *                                 (C++: copies the bits, a cast from void* is not portable C++)
 *
 * Compiles as C99 and C++17 with -Wall -Wextra -Wpedantic -Werror; everything is static inline (one counter per
 * test program, no unused-function warnings).
 */
#ifndef DFL2_TEST_H
#define DFL2_TEST_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#if !defined(_WIN32)
#include <dlfcn.h>
#endif

static inline int* dfl2TestCounter(void)
{
    static int sFailures = 0;
    return &sFailures;
}

static inline int dfl2TestFailures(void)
{
    return *dfl2TestCounter();
}

#define CHECK(cond)                                                                                                    \
    do                                                                                                                 \
    {                                                                                                                  \
        if (!(cond))                                                                                                   \
        {                                                                                                              \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond);                                   \
            ++*dfl2TestCounter();                                                                                      \
        }                                                                                                              \
    } while (0)

#define CHECK_MSG(cond, ...)                                                                                           \
    do                                                                                                                 \
    {                                                                                                                  \
        if (!(cond))                                                                                                   \
        {                                                                                                              \
            fprintf(stderr, "%s:%d: CHECK failed: %s: ", __FILE__, __LINE__, #cond);                                   \
            fprintf(stderr, __VA_ARGS__);                                                                              \
            fputc('\n', stderr);                                                                                       \
            ++*dfl2TestCounter();                                                                                      \
        }                                                                                                              \
    } while (0)

static inline int dfl2TestReport(const char* name)
{
    int const n = dfl2TestFailures();
    if (n != 0)
    {
        fprintf(stderr, "%s: %d check(s) failed\n", name, n);
        return 1;
    }
    printf("%s: ok\n", name);
    return 0;
}

#if defined(CUDART_VERSION)
#define CUDA_OK(call)                                                                                                  \
    do                                                                                                                 \
    {                                                                                                                  \
        cudaError_t const status_ = (call);                                                                            \
        if (status_ != cudaSuccess)                                                                                    \
        {                                                                                                              \
            fprintf(stderr, "%s:%d: %s -> %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(status_));              \
            exit(1);                                                                                                   \
        }                                                                                                              \
    } while (0)
#endif

#if !defined(_WIN32)
static inline void* dfl2TestSymbol(void* handle, const char* name)
{
    return dlsym(handle, name);
}
#endif

#if defined(__cplusplus) && !defined(_WIN32)
namespace dfl2Test
{
//! dlsym as a function pointer of type Fn (null when absent).
template <typename Fn>
Fn symbol(void* handle, char const* name)
{
    void* sym = dlsym(handle, name);
    Fn fn{};
    if (sym != nullptr)
    {
        memcpy(&fn, &sym, sizeof(fn));
    }
    return fn;
}
} // namespace dfl2Test
#endif

#endif /* DFL2_TEST_H */
