//! \file options.cpp
#include "options.h"

#include "core/ngram.h"

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <sstream>

namespace dflash2
{

std::vector<OptionSpec> const& optionSpecs()
{
    static std::vector<OptionSpec> const kSpecs = {
        {"max_new_tokens", OptionType::kINT, nullptr},
        {"temperature", OptionType::kDOUBLE, nullptr},
        {"seed", OptionType::kINT, nullptr},
        {"speculative", OptionType::kBOOL, nullptr},
        {"measure_oracle", OptionType::kBOOL, nullptr},
        {"eos_ids", OptionType::kINT_ARRAY, nullptr},
        {"proposer", OptionType::kSTRING, proposerChoices()},
        {"ngram_rows", OptionType::kINT, nullptr},
        {"guard", OptionType::kBOOL, nullptr},
        {"prefix_cache_bytes", OptionType::kINT, nullptr},
        {"logit_bias", OptionType::kSTRING, nullptr},
        {"repetition_penalty", OptionType::kDOUBLE, nullptr},
        {"frequency_penalty", OptionType::kDOUBLE, nullptr},
        {"presence_penalty", OptionType::kDOUBLE, nullptr},
        {"top_k", OptionType::kINT, nullptr},
        {"top_p", OptionType::kDOUBLE, nullptr},
        {"min_p", OptionType::kDOUBLE, nullptr},
        {"logprobs", OptionType::kBOOL, nullptr},
        {"top_logprobs", OptionType::kINT, nullptr},
        {"backend", OptionType::kSTRING, "auto|tensorrt|trt|ort"},
        {"draft_mode", OptionType::kSTRING, "greedy|viterbi|independent"},
        {"verify_checksums", OptionType::kBOOL, nullptr},
        {"plugin_library", OptionType::kSTRING, nullptr},
        {"device", OptionType::kINT, nullptr},
        {"cuda_graphs", OptionType::kBOOL, nullptr},
        {"threads", OptionType::kINT, nullptr},
        {"ort_library", OptionType::kSTRING, nullptr},
        {"ort_ops_library", OptionType::kSTRING, nullptr},
        {"max_batch", OptionType::kINT, nullptr},
        {"adaptive", OptionType::kBOOL, nullptr},
        {"prior_tau", OptionType::kDOUBLE, nullptr},
        {"prior_weight", OptionType::kDOUBLE, nullptr},
        {"tau_window", OptionType::kINT, nullptr},
        {"probe_after", OptionType::kINT, nullptr},
        {"fixed_costs", OptionType::kSTRING, nullptr},
        {"prefill_chunk", OptionType::kINT, nullptr},
        {"prefill_share", OptionType::kDOUBLE, nullptr},
    };
    return kSpecs;
}

char const* optionTypeName(OptionType t)
{
    switch (t)
    {
    case OptionType::kINT: return "int";
    case OptionType::kDOUBLE: return "double";
    case OptionType::kBOOL: return "bool";
    case OptionType::kSTRING: return "string";
    case OptionType::kINT_ARRAY: return "int[]";
    }
    return "?";
}

namespace
{

OptionSpec const& specOf(std::string const& key)
{
    for (OptionSpec const& s : optionSpecs())
    {
        if (key == s.key)
        {
            return s;
        }
    }
    std::string known;
    for (OptionSpec const& s : optionSpecs())
    {
        known += known.empty() ? "" : ", ";
        known += s.key;
    }
    throw Error(DFL2_ERR_UNKNOWN_OPTION, "unknown option '" + key + "' (known: " + known + ")");
}

OptionType typeOf(OptionValue const& v)
{
    static OptionType const kByIndex[] = {
        OptionType::kINT, OptionType::kDOUBLE, OptionType::kBOOL, OptionType::kSTRING, OptionType::kINT_ARRAY};
    return kByIndex[v.index()];
}

// Why a real-valued option is out of its range (request.GenerationRequest's, the speculation rule's), or "".
std::string realRangeError(std::string const& key, double x)
{
    bool ok = true;
    char const* want = "";
    if (key == "top_p")
    {
        ok = x > 0 && x <= 1;
        want = "in (0, 1]";
    }
    else if (key == "min_p")
    {
        ok = x >= 0 && x <= 1;
        want = "in [0, 1]";
    }
    else if (key == "repetition_penalty")
    {
        ok = std::isfinite(x) && x > 0;
        want = "a finite number > 0 (1: off)";
    }
    else if (key == "presence_penalty" || key == "frequency_penalty")
    {
        ok = x >= -2 && x <= 2;
        want = "in [-2, 2]";
    }
    else if (key == "prior_tau" || key == "temperature")
    {
        ok = std::isfinite(x) && x >= 0;
        want = "a finite number >= 0";
    }
    else if (key == "prior_weight")
    {
        ok = std::isfinite(x) && x > 0;
        want = "a finite number > 0";
    }
    if (ok)
    {
        return "";
    }
    std::ostringstream os;
    os << "must be " << want << ", got " << x;
    return os.str();
}

void checkRange(std::string const& key, OptionSpec const& spec, OptionValue const& v)
{
    auto bad = [&](std::string const& why) { throw Error(DFL2_ERR_OPTION_VALUE, "option '" + key + "' " + why); };
    if (key == "max_new_tokens" && std::get<int64_t>(v) < 1)
    {
        bad("must be >= 1, got " + std::to_string(std::get<int64_t>(v)));
    }
    if (key == "seed" && std::get<int64_t>(v) < 0)
    {
        bad("must be >= 0 (as the Python API's seed), got " + std::to_string(std::get<int64_t>(v)));
    }
    if (key == "top_k" && (std::get<int64_t>(v) < -1 || std::get<int64_t>(v) > INT32_MAX))
    {
        bad("must be >= 0 (0 or -1: all tokens), got " + std::to_string(std::get<int64_t>(v)));
    }
    if (key == "top_logprobs" && (std::get<int64_t>(v) < 0 || std::get<int64_t>(v) > 20))
    {
        bad("must be in [0, 20], got " + std::to_string(std::get<int64_t>(v)));
    }
    if (std::holds_alternative<double>(v))
    {
        std::string const why = realRangeError(key, std::get<double>(v));
        if (!why.empty())
        {
            bad(why);
        }
    }
    if (key == "logit_bias")
    {
        parseLogitBias(std::get<std::string>(v));
    }
    if (key == "prefix_cache_bytes" && std::get<int64_t>(v) < 0)
    {
        bad("must be >= 0 (0: keep nothing), got " + std::to_string(std::get<int64_t>(v)));
    }
    if (key == "device" && (std::get<int64_t>(v) < 0 || std::get<int64_t>(v) > 1024))
    {
        bad("must be a CUDA device ordinal >= 0, got " + std::to_string(std::get<int64_t>(v)));
    }
    if (key == "prefill_chunk" && (std::get<int64_t>(v) < 0 || std::get<int64_t>(v) > INT32_MAX))
    {
        bad("must be >= 0 (0: no cap), got " + std::to_string(std::get<int64_t>(v)));
    }
    if (key == "prefill_share" && !(std::isfinite(std::get<double>(v)) && std::get<double>(v) >= 0))
    {
        bad("must be a finite number >= 0 (0: no time budget), got " + std::to_string(std::get<double>(v)));
    }
    if (key == "ngram_rows" && (std::get<int64_t>(v) < 0 || std::get<int64_t>(v) > INT32_MAX))
    {
        bad("must be >= 0 (0: the default, max(4, block_size - 1)), got " + std::to_string(std::get<int64_t>(v)));
    }
    if (key == "threads" && (std::get<int64_t>(v) < 0 || std::get<int64_t>(v) > 4096))
    {
        bad("must be >= 0 (0: ONNX Runtime's default), got " + std::to_string(std::get<int64_t>(v)));
    }
    if ((key == "tau_window" || key == "probe_after") && std::get<int64_t>(v) < 1)
    {
        bad("must be >= 1, got " + std::to_string(std::get<int64_t>(v)));
    }
    if (key == "max_batch" && (std::get<int64_t>(v) < 0 || std::get<int64_t>(v) > INT32_MAX))
    {
        bad("must be >= 0 (0: the model's), got " + std::to_string(std::get<int64_t>(v)));
    }
    if (key == "fixed_costs")
    {
        parseFixedCosts(std::get<std::string>(v));
    }
    if (spec.choices != nullptr)
    {
        std::string const& s = std::get<std::string>(v);
        std::string const choices = spec.choices;
        std::stringstream ss(choices);
        std::string item;
        while (std::getline(ss, item, '|'))
        {
            if (item == s)
            {
                return;
            }
        }
        bad("must be one of " + choices + ", got '" + s + "'");
    }
}

int64_t parseInt(std::string const& key, std::string const& text)
{
    errno = 0;
    char* end = nullptr;
    long long const v = std::strtoll(text.c_str(), &end, 10);
    if (text.empty() || end != text.c_str() + text.size() || errno == ERANGE)
    {
        throw Error(DFL2_ERR_OPTION_TYPE, "option '" + key + "' needs an int, got '" + text + "'");
    }
    return static_cast<int64_t>(v);
}

} // namespace

void Options::set(std::string const& key, OptionValue value)
{
    OptionSpec const& spec = specOf(key);
    if (typeOf(value) != spec.type)
    {
        throw Error(DFL2_ERR_OPTION_TYPE,
            "option '" + key + "' is of type " + optionTypeName(spec.type) + ", set as " + optionTypeName(typeOf(value)));
    }
    checkRange(key, spec, value);
    mValues[key] = std::move(value);
}

void Options::parse(std::string const& keyEqualsValue)
{
    size_t const eq = keyEqualsValue.find('=');
    if (eq == std::string::npos)
    {
        throw Error(DFL2_ERR_INVALID_ARGUMENT, "option text must be key=value, got '" + keyEqualsValue + "'");
    }
    std::string const key = keyEqualsValue.substr(0, eq);
    std::string const text = keyEqualsValue.substr(eq + 1);
    OptionSpec const& spec = specOf(key);
    switch (spec.type)
    {
    case OptionType::kINT: set(key, parseInt(key, text)); return;
    case OptionType::kDOUBLE:
    {
        char* end = nullptr;
        double const v = std::strtod(text.c_str(), &end);
        if (text.empty() || end != text.c_str() + text.size())
        {
            throw Error(DFL2_ERR_OPTION_TYPE, "option '" + key + "' needs a number, got '" + text + "'");
        }
        set(key, v);
        return;
    }
    case OptionType::kBOOL:
        if (text == "true" || text == "1")
        {
            set(key, true);
        }
        else if (text == "false" || text == "0")
        {
            set(key, false);
        }
        else
        {
            throw Error(DFL2_ERR_OPTION_TYPE, "option '" + key + "' needs true|false|1|0, got '" + text + "'");
        }
        return;
    case OptionType::kSTRING: set(key, text); return;
    case OptionType::kINT_ARRAY:
    {
        std::vector<int32_t> ids;
        std::stringstream ss(text);
        std::string item;
        while (!text.empty() && std::getline(ss, item, ','))
        {
            int64_t const v = parseInt(key, item);
            if (v < INT32_MIN || v > INT32_MAX)
            {
                throw Error(DFL2_ERR_OPTION_VALUE, "option '" + key + "': " + item + " does not fit int32");
            }
            ids.push_back(static_cast<int32_t>(v));
        }
        if (!text.empty() && text.back() == ',')
        {
            throw Error(DFL2_ERR_OPTION_TYPE, "option '" + key + "' ends with a comma: '" + text + "'");
        }
        set(key, std::move(ids));
        return;
    }
    }
}

int64_t Options::getInt(std::string const& key, int64_t fallback) const
{
    auto it = mValues.find(key);
    return it == mValues.end() ? fallback : std::get<int64_t>(it->second);
}

double Options::getDouble(std::string const& key, double fallback) const
{
    auto it = mValues.find(key);
    return it == mValues.end() ? fallback : std::get<double>(it->second);
}

bool Options::getBool(std::string const& key, bool fallback) const
{
    auto it = mValues.find(key);
    return it == mValues.end() ? fallback : std::get<bool>(it->second);
}

std::string Options::getString(std::string const& key, std::string const& fallback) const
{
    auto it = mValues.find(key);
    return it == mValues.end() ? fallback : std::get<std::string>(it->second);
}

std::vector<int32_t> Options::getIntArray(std::string const& key, std::vector<int32_t> const& fallback) const
{
    auto it = mValues.find(key);
    return it == mValues.end() ? fallback : std::get<std::vector<int32_t>>(it->second);
}

std::vector<std::pair<int32_t, double>> parseLogitBias(std::string const& text)
{
    std::vector<std::pair<int32_t, double>> pairs;
    std::stringstream ss(text);
    std::string item;
    while (!text.empty() && std::getline(ss, item, ','))
    {
        size_t const colon = item.find(':');
        char* endId = nullptr;
        char* endBias = nullptr;
        long long const id = colon == std::string::npos ? -1 : std::strtoll(item.c_str(), &endId, 10);
        double const bias = colon == std::string::npos ? NAN : std::strtod(item.c_str() + colon + 1, &endBias);
        if (colon == std::string::npos || colon == 0 || endId != item.c_str() + colon || id < 0 || id > INT32_MAX
            || endBias != item.c_str() + item.size() || colon + 1 == item.size() || !(bias >= -100 && bias <= 100))
        {
            throw Error(DFL2_ERR_OPTION_VALUE, "option 'logit_bias' must be 'id:bias,...' (id >= 0, bias in [-100, "
                "100]), got '" + text + "'");
        }
        pairs.emplace_back(static_cast<int32_t>(id), bias);
    }
    if (!text.empty() && text.back() == ',')
    {
        throw Error(DFL2_ERR_OPTION_VALUE, "option 'logit_bias' ends with a comma: '" + text + "'");
    }
    return pairs;
}

std::vector<double> parseFixedCosts(std::string const& text)
{
    std::vector<double> costs;
    if (text.empty())
    {
        return costs;
    }
    std::stringstream ss(text);
    std::string item;
    while (std::getline(ss, item, ','))
    {
        char* end = nullptr;
        double const x = std::strtod(item.c_str(), &end);
        if (item.empty() || end != item.c_str() + item.size() || !std::isfinite(x) || x < 0)
        {
            costs.clear();
            break;
        }
        costs.push_back(x);
    }
    if ((costs.size() != 4 && costs.size() != 6) || text.back() == ',')
    {
        throw Error(DFL2_ERR_OPTION_VALUE,
            "option 'fixed_costs' must be empty (measured) or 4 or 6 numbers >= 0 in seconds, "
            "'plain_base,plain_per_sequence,draft,verify[,step,prefill_row]', got '" + text + "'");
    }
    return costs;
}

GenerateConfig generateConfig(Options const& options, std::vector<int32_t> const& modelEos)
{
    GenerateConfig c;
    c.maxNewTokens = options.getInt("max_new_tokens", 64);
    c.temperature = options.getDouble("temperature", 0.0);
    c.speculative = options.getBool("speculative", true);
    c.measureOracle = options.getBool("measure_oracle", false);
    c.eosIds = options.getIntArray("eos_ids", modelEos);
    c.proposer = proposerOf(options.getString("proposer", "auto"));
    c.ngramRows = static_cast<int32_t>(options.getInt("ngram_rows", 0));
    if (options.getBool("guard", false))
    {
        c.guard = GuardConfig{};
    }
    SamplingConfig& sc = c.sampling;
    sc.topK = static_cast<int32_t>(std::max<int64_t>(0, options.getInt("top_k", 0)));
    sc.topP = options.getDouble("top_p", 1.0);
    sc.minP = options.getDouble("min_p", 0.0);
    sc.presencePenalty = options.getDouble("presence_penalty", 0.0);
    sc.frequencyPenalty = options.getDouble("frequency_penalty", 0.0);
    sc.repetitionPenalty = options.getDouble("repetition_penalty", 1.0);
    sc.logitBias = parseLogitBias(options.getString("logit_bias", ""));
    sc.logprobs = options.getBool("logprobs", false);
    sc.topLogprobs = static_cast<int32_t>(options.getInt("top_logprobs", 0));
    if (sc.topLogprobs > 0 && !sc.logprobs)
    {
        throw Error(DFL2_ERR_OPTION_VALUE, "option 'top_logprobs' needs 'logprobs' true");
    }
    return c;
}

} // namespace dflash2
