// libFuzzer target over the two parsers that read untrusted text: manifest.json (parseManifest) and
// option strings (Options::parse). The first byte picks the parser; any input must end in a clean
// dflash2::Error or success — a crash, leak, overflow or undefined behaviour fails the run (ASan/UBSan).
#include "manifest.h"
#include "options.h"

#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>

extern "C" int LLVMFuzzerTestOneInput(uint8_t const* data, size_t size)
{
    if (size == 0)
    {
        return 0;
    }
    std::string const text(reinterpret_cast<char const*>(data) + 1, size - 1);
    try
    {
        if (data[0] & 1)
        {
            dflash2::Manifest const m = dflash2::parseManifest(text, "fuzz");
            (void) m;
        }
        else
        {
            dflash2::Options o;
            std::stringstream lines(text);
            std::string line;
            while (std::getline(lines, line))
            {
                try
                {
                    o.parse(line);
                }
                catch (dflash2::Error const&)
                {
                }
            }
            (void) dflash2::generateConfig(o, {});
        }
    }
    catch (dflash2::Error const&)
    {
    }
    return 0;
}
