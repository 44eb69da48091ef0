// infer — the command-line program around infer.hpp.
//
//   infer generate [-m PATH] [-p TEXT] [-n N] [--temp T] [--top-k K] [--top-p P] [--min-p P] [--seed S]
//                  [--repetition-penalty R] [--presence-penalty P] [--frequency-penalty F] [--ignore-eos]
//                  [-t THREADS] [--tokenizer FILE] [--prompt-ids 1,2,3] [--ids]
//   infer logits -m PATH --tokens 1,2,3 --out FILE [-t THREADS]
//   infer make-model -o DIR [--dim D --layers L --heads H --kv-heads K --ffn F --vocab V --context C]
//                    [--dtype f32|bf16|f16] [--seed S] [--tied]
//
// Without -m, generate runs a built-in demo model with random weights, so the first command works anywhere.
#include "../infer.hpp"
#include "command_line.hpp"

#include <cstdio>
#include <iostream>

namespace {

const char* usage_text = R"(usage:
  infer generate [-m PATH] [-p TEXT] [-n N] [--temp T] [--top-k K] [--top-p P] [--min-p P] [--seed S]
                 [--repetition-penalty R] [--presence-penalty P] [--frequency-penalty F] [--ignore-eos]
                 [-t THREADS] [--tokenizer FILE] [--prompt-ids 1,2,3] [--ids]
  infer logits -m PATH --tokens 1,2,3 --out FILE [-t THREADS] [--tokenizer FILE]
  infer make-model -o DIR [--dim D] [--layers L] [--heads H] [--kv-heads K] [--ffn F] [--vocab V]
                   [--context C] [--dtype f32|bf16|f16] [--seed S] [--tied]

  -m PATH   a Hugging Face folder (config.json + *.safetensors), a .gguf file, or a llama2.c .bin
            (its tokenizer: --tokenizer FILE, default tokenizer.bin beside it)
  -t N      threads for the matmuls (default: all cores)
)";

std::vector<int> parse_ids(const std::string& option, const std::string& list) {
    std::vector<int> ids;
    std::stringstream in(list);
    std::string item;
    while (std::getline(in, item, ',')) {
        size_t used = 0;
        long long id = -1;
        try {
            id = std::stoll(item, &used);
        } catch (const std::exception&) {
            used = 0;
        }
        if (used != item.size() || item.empty() || id < 0 || id > std::numeric_limits<int>::max())
            infer::detail::fail("option ", option, ": \"", item, "\" is not a token id");
        ids.push_back(static_cast<int>(id));
    }
    if (ids.empty()) infer::detail::fail("option ", option, " needs at least one token id");
    return ids;
}

int thread_count(const CommandLine& options) {
    long long threads = options.integer("-t", 0);
    if (threads < 0 || threads > 1024) infer::detail::fail("option -t: ", threads, " threads is out of range (1..1024, 0 = all cores)");
    return static_cast<int>(threads);
}

infer::Model load(const CommandLine& options, infer::LayerTimes& times) {
    infer::Stopwatch clock;
    infer::Model model = infer::load_model(options.text("-m"), options.text("--tokenizer"));
    times.load = clock.seconds();
    return model;
}

void print_json_ids(std::ostream& out, const char* name, const std::vector<int>& ids) {
    out << '"' << name << "\":[";
    for (size_t i = 0; i < ids.size(); ++i) out << (i ? "," : "") << ids[i];
    out << ']';
}

int run_generate(const CommandLine& options) {
    infer::LayerTimes load_times;
    infer::Model model;
    if (options.has("-m")) {
        model = load(options, load_times);
    } else {
        infer::Stopwatch clock;
        model = infer::demo_model();
        load_times.load = clock.seconds();
        std::cerr << "note: no -m given, so this runs the built-in demo model: random weights and a byte vocabulary.\n"
                     "      Its output is meaningless. Load a real checkpoint with -m (see README.md), e.g.\n"
                     "      infer generate -m stories15M.bin -p \"Once upon a time\"\n";
    }
    infer::SamplingParams params;  // llama.cpp's defaults for a command-line run
    params.temperature = static_cast<float>(options.number("--temp", 0.8));
    params.top_k = static_cast<int>(options.integer("--top-k", 40));
    params.top_p = static_cast<float>(options.number("--top-p", 0.95));
    params.min_p = static_cast<float>(options.number("--min-p", 0.05));
    params.repetition_penalty = static_cast<float>(options.number("--repetition-penalty", 1.0));
    params.presence_penalty = static_cast<float>(options.number("--presence-penalty", 0.0));
    params.frequency_penalty = static_cast<float>(options.number("--frequency-penalty", 0.0));
    long long max_tokens = options.integer("-n", 256);
    if (max_tokens < 0 || max_tokens > std::numeric_limits<int>::max()) infer::detail::fail("option -n: ", max_tokens, " is out of range");
    params.max_tokens = static_cast<int>(max_tokens);
    params.ignore_eos = options.has("--ignore-eos");
    if (options.has("--seed")) params.seed = static_cast<uint64_t>(options.integer("--seed", 0));
    params.validate();

    infer::ThreadPool pool(thread_count(options));
    const bool ids_only = options.has("--ids");
    auto stream = [&](std::string_view text) {
        if (!ids_only) std::cout << text << std::flush;
    };
    infer::GenerationResult result;
    if (options.has("--prompt-ids")) {
        result = infer::generate_from_ids(model, pool, parse_ids("--prompt-ids", options.text("--prompt-ids")), params, stream);
    } else {
        std::string prompt = options.text("-p");
        if (!ids_only) std::cout << prompt << std::flush;
        result = infer::generate(model, pool, prompt, params, stream);
    }
    if (ids_only) {
        std::cout << '{';
        print_json_ids(std::cout, "prompt_ids", result.prompt_ids);
        std::cout << ',';
        print_json_ids(std::cout, "generated_ids", result.generated_ids);
        std::cout << "}\n";
    } else {
        std::cout << '\n';
    }

    const infer::LayerTimes& t = result.times;
    const size_t decode_steps = result.generated_ids.empty() ? 0 : result.generated_ids.size() - 1;
    auto per_second = [](double count, double seconds) { return seconds > 0 ? count / seconds : 0.0; };
    std::fprintf(stderr,
                 "\nprompt: %zu tokens, generated: %zu tokens (finish: %s, seed %llu)\n"
                 "prefill: %.1f tokens/s   decode: %.1f tokens/s\n"
                 "time by layer (ms): load %.1f | tokenize %.2f | prefill %.1f | decode %.1f | sample %.2f | detokenize %.2f\n",
                 result.prompt_ids.size(), result.generated_ids.size(), result.finish_reason.c_str(),
                 static_cast<unsigned long long>(result.seed), per_second(static_cast<double>(result.prompt_ids.size()), t.prefill),
                 per_second(static_cast<double>(decode_steps), t.decode), load_times.load * 1e3, t.tokenize * 1e3,
                 t.prefill * 1e3, t.decode * 1e3, t.sample * 1e3, t.detokenize * 1e3);
    return 0;
}

int run_logits(const CommandLine& options) {
    if (!options.has("-m")) infer::detail::fail("infer logits needs -m PATH");
    if (!options.has("--tokens")) infer::detail::fail("infer logits needs --tokens 1,2,3");
    if (!options.has("--out")) infer::detail::fail("infer logits needs --out FILE");
    infer::LayerTimes times;
    infer::Model model = load(options, times);
    std::vector<int> tokens = parse_ids("--tokens", options.text("--tokens"));
    const int n = static_cast<int>(tokens.size());
    if (n > model.config.context_length)
        infer::detail::fail("--tokens has ", n, " tokens, but the model's context holds ", model.config.context_length);
    infer::ThreadPool pool(thread_count(options));
    infer::KVCache cache(model.config, (n + 15) / 16, 16);
    cache.reserve(0, n);
    infer::Batch batch;
    for (int i = 0; i < n; ++i) batch.add(tokens[i], i, 0, true);
    infer::ForwardPass forward(model, pool);
    std::span<const float> logits = forward.forward(batch, cache);
    std::ofstream out(options.text("--out"), std::ios::binary);
    if (!out) infer::detail::fail(options.text("--out"), ": cannot create");
    out.write(reinterpret_cast<const char*>(logits.data()), static_cast<std::streamsize>(logits.size_bytes()));
    if (!out) infer::detail::fail(options.text("--out"), ": write failed");
    std::cerr << "wrote " << n << " x " << model.config.vocab_size << " float32 logits to " << options.text("--out") << '\n';
    return 0;
}

int run_make_model(const CommandLine& options) {
    if (!options.has("-o")) infer::detail::fail("infer make-model needs -o DIR");
    infer::ModelShape shape;
    auto dimension = [&](const char* name, int fallback) {
        long long value = options.integer(name, fallback);
        if (value <= 0 || value > (1 << 20)) infer::detail::fail("option ", name, ": ", value, " is out of range (1..1048576)");
        return static_cast<int>(value);
    };
    shape.dim = dimension("--dim", shape.dim);
    shape.n_layers = dimension("--layers", shape.n_layers);
    shape.n_heads = dimension("--heads", shape.n_heads);
    shape.n_kv_heads = dimension("--kv-heads", options.has("--heads") ? shape.n_heads : shape.n_kv_heads);
    shape.ffn_dim = dimension("--ffn", shape.ffn_dim);
    shape.vocab_size = dimension("--vocab", shape.vocab_size);
    shape.context_length = dimension("--context", shape.context_length);
    shape.tied_embeddings = options.has("--tied");
    std::string dtype_text = options.text("--dtype", "f32");
    infer::DType dtype;
    if (dtype_text == "f32") dtype = infer::DType::F32;
    else if (dtype_text == "bf16") dtype = infer::DType::BF16;
    else if (dtype_text == "f16") dtype = infer::DType::F16;
    else infer::detail::fail("option --dtype: \"", dtype_text, "\" is not one of f32, bf16, f16");
    infer::save_random_model(options.text("-o"), shape, dtype, static_cast<uint64_t>(options.integer("--seed", 0)));
    infer::Model check = infer::load_model(options.text("-o"));  // read it back: what we wrote must load
    std::cerr << "wrote " << options.text("-o") << ": " << check.parameter_count() << " parameters in " << dtype_text
              << "; a decode step reads " << check.weight_bytes_per_token() / 1e6 << " MB of them\n";
    return 0;
}

}  // namespace

int main(int argc, char** argv) {
    try {
        std::string command = argc > 1 ? argv[1] : "";
        if (command == "generate")
            return run_generate(CommandLine(argc, argv, 2,
                                        {"-m", "-p", "-n", "--temp", "--top-k", "--top-p", "--min-p", "--seed", "-t",
                                         "--repetition-penalty", "--presence-penalty", "--frequency-penalty",
                                         "--tokenizer", "--prompt-ids"},
                                        {"--ignore-eos", "--ids"}, usage_text));
        if (command == "logits")
            return run_logits(CommandLine(argc, argv, 2, {"-m", "--tokens", "--out", "-t", "--tokenizer"}, {}, usage_text));
        if (command == "make-model")
            return run_make_model(CommandLine(argc, argv, 2,
                                          {"-o", "--dim", "--layers", "--heads", "--kv-heads", "--ffn", "--vocab",
                                           "--context", "--dtype", "--seed"},
                                          {"--tied"}, usage_text));
        if (command == "-h" || command == "--help" || command == "help") {
            std::cout << usage_text;
            return 0;
        }
        std::cerr << (command.empty() ? "error: no command given\n" : "error: unknown command \"" + command + "\"\n")
                  << usage_text;
        return 2;
    } catch (const std::exception& e) {
        std::cerr << "error: " << e.what() << '\n';
        return 1;
    }
}
