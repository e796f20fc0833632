//! \file options.h
//! The option table of the C API (keys, types, defaults, ranges: the one place they are defined; the
//! header's OPTIONS list documents the same table and tests/test_capi.py pins the two together) and the
//! typed store behind dfl2_options.
#pragma once

#include "core/decoder.h"

#include <cstdint>
#include <map>
#include <string>
#include <variant>
#include <vector>

namespace dflash2
{

enum class OptionType
{
    kINT,
    kDOUBLE,
    kBOOL,
    kSTRING,
    kINT_ARRAY
};

using OptionValue = std::variant<int64_t, double, bool, std::string, std::vector<int32_t>>;

struct OptionSpec
{
    char const* key;
    OptionType type;
    char const* choices;  //!< "a|b|c" for strings with fixed choices, else nullptr
};

//! The known keys, in the header's order.
std::vector<OptionSpec> const& optionSpecs();
char const* optionTypeName(OptionType t);

class Options
{
public:
    //! Typed setters: unknown key -> DFL2_ERR_UNKNOWN_OPTION, other type -> DFL2_ERR_OPTION_TYPE, value out of
    //! range / not a choice -> DFL2_ERR_OPTION_VALUE.
    void set(std::string const& key, OptionValue value);
    //! "key=value", the value parsed by the key's type.
    void parse(std::string const& keyEqualsValue);

    bool has(std::string const& key) const
    {
        return mValues.count(key) != 0;
    }
    int64_t getInt(std::string const& key, int64_t fallback) const;
    double getDouble(std::string const& key, double fallback) const;
    bool getBool(std::string const& key, bool fallback) const;
    std::string getString(std::string const& key, std::string const& fallback) const;
    std::vector<int32_t> getIntArray(std::string const& key, std::vector<int32_t> const& fallback) const;

private:
    std::map<std::string, OptionValue> mValues;
};

//! "fixed_costs": "" -> {} (measured), "a,b,d,v" -> {a, b, d, v} (seconds, each >= 0), else DFL2_ERR_OPTION_VALUE.
std::vector<double> parseFixedCosts(std::string const& text);

//! "logit_bias": "" -> {} (none), "id:bias,id:bias" -> the pairs (id >= 0, bias a number in [-100, 100] as OpenAI's;
//! the last of an id's wins), else DFL2_ERR_OPTION_VALUE.
std::vector<std::pair<int32_t, double>> parseLogitBias(std::string const& text);

//! The generation settings a session (and a batched request) reads from options (defaults from the header's table).
GenerateConfig generateConfig(Options const& options, std::vector<int32_t> const& modelEos);

} // namespace dflash2
