// command_line.hpp — the option parser the example programs share. Each program names the options it takes; anything
// else, a missing value or a malformed number is an infer::Error that names the option, so a typo never runs silently.
#pragma once

#include "infer.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <iostream>
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <vector>

// The whole of `text` as a number, or an error naming the option and saying what was expected (`what`).
inline double parse_number(const std::string& option, const std::string& text, const std::string& what) {
    size_t used = 0;
    double value = 0;
    try {
        value = std::stod(text, &used);
    } catch (const std::exception&) {
        used = 0;
    }
    if (text.empty() || used != text.size()) infer::fail("option ", option, ": \"", text, "\" is not ", what);
    return value;
}

// A comma list of positive integers ("1,4,16"), each error naming the option.
inline std::vector<int> parse_int_list(const std::string& option, const std::string& text) {
    std::vector<int> values;
    std::stringstream in(text);
    std::string item;
    while (std::getline(in, item, ',')) {
        double v = parse_number(option, item, "a positive integer");
        if (v < 1 || v != std::floor(v) || v > 1e7) infer::fail("option ", option, ": \"", item, "\" is not a positive integer");
        values.push_back(static_cast<int>(v));
    }
    if (values.empty()) infer::fail("option ", option, ": empty; expected e.g. 1,4,16");
    return values;
}

class CommandLine {
public:
    // Reads argv[first..]: options in `with_value` take the next argument, options in `flags` stand alone. -h/--help
    // prints `usage` and exits.
    CommandLine(int argc, char** argv, int first, const std::vector<std::string>& with_value,
                const std::vector<std::string>& flags, const std::string& usage) {
        for (int i = first; i < argc; ++i) {
            std::string name = canonical_name(argv[i], with_value, flags);
            if (name == "-h" || name == "--help") {
                std::cout << usage;
                std::exit(0);
            }
            if (std::find(flags.begin(), flags.end(), name) != flags.end()) {
                values_.insert_or_assign(name, std::string("1"));
            } else if (std::find(with_value.begin(), with_value.end(), name) != with_value.end()) {
                if (i + 1 >= argc) infer::fail("option ", name, " needs a value");
                values_[name] = argv[++i];
            } else {
                infer::fail("unknown option \"", name, "\"\n", usage);
            }
        }
    }

    // llama.cpp's spellings of the same options, so the commands people already type work here too. An alias counts
    // only where the program takes the option it stands for.
    static std::string canonical_name(const std::string& name, const std::vector<std::string>& with_value,
                                      const std::vector<std::string>& flags) {
        static const std::map<std::string, std::string> aliases = {
            {"--model", "-m"},          {"--prompt", "-p"},       {"--threads", "-t"},       {"--n-predict", "-n"},
            {"-s", "--seed"},           {"--file", "-f"},         {"--repeat-penalty", "--repetition-penalty"},
            {"--temperature", "--temp"}, {"-sys", "--system"},    {"--ctx-size", "-c"},
            {"-ctk", "--cache-type-k"},  {"-ctv", "--cache-type-v"}};
        auto found = aliases.find(name);
        if (found == aliases.end()) return name;
        const std::string& target = found->second;
        bool taken = std::find(with_value.begin(), with_value.end(), target) != with_value.end() ||
                     std::find(flags.begin(), flags.end(), target) != flags.end();
        return taken ? target : name;
    }

    bool has(const std::string& name) const { return values_.count(name) > 0; }

    std::string text(const std::string& name, const std::string& fallback = "") const {
        auto found = values_.find(name);
        return found == values_.end() ? fallback : found->second;
    }

    // An integer in [low, high]; std::stoll alone would accept "12abc".
    long long integer(const std::string& name, long long fallback, long long low = std::numeric_limits<long long>::min(),
                      long long high = std::numeric_limits<long long>::max()) const {
        if (!has(name)) return fallback;
        const std::string& value = values_.at(name);
        size_t used = 0;
        long long number = 0;
        try {
            number = std::stoll(value, &used);
        } catch (const std::exception&) {
            used = 0;
        }
        if (used != value.size() || value.empty()) infer::fail("option ", name, ": \"", value, "\" is not an integer");
        if (number < low || number > high)
            infer::fail("option ", name, ": ", number, " is out of range (", low, "..", high, ")");
        return number;
    }

    double number(const std::string& name, double fallback) const {
        return has(name) ? parse_number(name, values_.at(name), "a number") : fallback;
    }

private:
    std::map<std::string, std::string> values_;
};

// How a command's model files reach memory: mapped (the default), or read into memory with --no-mmap (chapter 02;
// chapter 07, "Pages", for what a mapped file's 4 KB pages cost a prefill). It holds for every model the command loads.
inline infer::FileAccess file_access(const CommandLine& options) {
    return options.has("--no-mmap") ? infer::FileAccess::Read : infer::FileAccess::Map;
}

// The model of -m, with the tokenizer of --tokenizer where one is given.
inline infer::Model model_option(const CommandLine& options) {
    return infer::load_model(options.text("-m"), options.text("--tokenizer"), file_access(options));
}

// The model a chapter program runs: the one at `path`, or (empty path) the built-in demo model, with a note saying so.
inline infer::Model model_or_demo(const std::string& path) {
    if (!path.empty()) return infer::load_model(path);
    std::cerr << "note: no -m given, so this runs the built-in demo model (random weights; the figures are real)\n";
    return infer::demo_model();
}

// -c N (llama.cpp's --ctx-size): run the model at N positions at most, which bounds prompt + output and the KV cache a
// request can take. 0 or no -c: the model's own context. More than the model was built for is refused: positions
// past its training are out of distribution, and the model would only break down there.
inline void apply_context_option(infer::Model& model, const CommandLine& options) {
    const long long context = options.integer("-c", 0, 0, std::numeric_limits<int>::max());
    if (context == 0) return;
    if (context > model.config.context_length)
        infer::fail("option -c: ", context, " positions is more than ", model.source, " was built for (",
                    model.config.context_length, "); use at most that, or 0 for all of it");
    model.config.context_length = static_cast<int>(context);
}

// Speculative decoding's options, shared by generate, run-batch, serve and bench engine: --spec ngram|draft|none,
// --draft-model PATH (loaded here once; every engine built from the config shares it), --spec-k K (ids drafted per
// step, default 4) and --spec-ngram N (prompt lookup's longest suffix, default 3). --draft-model alone means draft.
inline infer::SpecConfig spec_config(const CommandLine& options) {
    infer::SpecConfig spec;
    spec.method = infer::parse_spec_method(options.text("--spec", options.has("--draft-model") ? "draft" : "none"));
    spec.k = static_cast<int>(options.integer("--spec-k", spec.k, 1, 64));
    spec.ngram = static_cast<int>(options.integer("--spec-ngram", spec.ngram, 1, 64));
    if (spec.method == infer::SpecMethod::None)
        for (const char* option : {"--spec-k", "--spec-ngram"})
            if (options.has(option)) infer::fail("option ", option, " needs --spec ngram or --spec draft");
    if (spec.method == infer::SpecMethod::Draft) {
        if (!options.has("--draft-model")) infer::fail("--spec draft needs a draft model: --draft-model PATH");
        spec.draft_model =
            std::make_shared<infer::Model>(infer::load_model(options.text("--draft-model"), {}, file_access(options)));
    } else if (options.has("--draft-model")) {
        infer::fail("option --draft-model is for --spec draft, not --spec ", infer::spec_method_name(spec.method));
    }
    return spec;
}

// A float type named by an option's value, any case: f32, f16 or bf16 (make-model's --dtype, --cache-type).
inline infer::DType float_type(const std::string& option, const std::string& text) {
    std::string name = text;
    std::transform(name.begin(), name.end(), name.begin(), [](unsigned char ch) { return std::tolower(ch); });
    if (name == "f32") return infer::DType::F32;
    if (name == "f16") return infer::DType::F16;
    if (name == "bf16") return infer::DType::BF16;
    infer::fail("option ", option, ": \"", text, "\" is not f32, f16 or bf16");
}

// --cache-type f32|f16|bf16: how the KV cache stores keys and values. llama.cpp's --cache-type-k/-ctk and
// --cache-type-v/-ctv are taken too, where they name the same type (infer keeps K and V in one type).
inline infer::DType cache_type(const CommandLine& options) {
    infer::DType chosen = infer::DType::F32;
    std::string chosen_by;
    for (const char* option : {"--cache-type", "--cache-type-k", "--cache-type-v"}) {
        if (!options.has(option)) continue;
        const infer::DType type = float_type(option, options.text(option));
        if (!chosen_by.empty() && type != chosen)
            infer::fail("options ", chosen_by, " ", options.text(chosen_by), " and ", option, " ", options.text(option),
                        " differ: the KV cache keeps keys and values in one type");
        chosen = type;
        chosen_by = option;
    }
    return chosen;
}

// The engine options run-batch and serve share: --policy, --max-batch-tokens, --max-seqs, --block-size, --kv-blocks,
// --kv-memory, --cache-type, --no-prefix-cache, --device and the --spec options (a program that does not list an
// option simply gets its default).
inline infer::EngineConfig engine_config(const CommandLine& options) {
    infer::EngineConfig config;
    const std::string policy = options.text("--policy", "continuous");
    if (policy == "static") config.scheduler.policy = infer::SchedulePolicy::Static;
    else if (policy != "continuous") infer::fail("option --policy: \"", policy, "\" is not continuous or static");
    config.scheduler.max_batch_tokens = static_cast<int>(options.integer("--max-batch-tokens", 512, 1, 1 << 20));
    config.scheduler.max_seqs = static_cast<int>(options.integer("--max-seqs", 64, 1, 1 << 16));
    config.block_size = static_cast<int>(options.integer("--block-size", 16, 1, 4096));
    config.num_blocks = static_cast<int>(options.integer("--kv-blocks", 0, 1, std::numeric_limits<int>::max()));
    config.kv_memory_bytes = static_cast<size_t>(options.integer("--kv-memory", 0, 1, std::numeric_limits<long long>::max()));
    config.kv_dtype = cache_type(options);
    config.prefix_caching = !options.has("--no-prefix-cache");
    config.device = infer::parse_device(options.text("--device", "cpu"));
    config.spec = spec_config(options);
    return config;
}
