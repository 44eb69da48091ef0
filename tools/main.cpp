// infer — the command-line program around infer.hpp: generate, chat, run-batch, serve, route, bench, quantize, pull and
// the tokenizer and model tools. Its commands and options are usage_text below, which `infer --help` prints. Without
// -m, generate runs a built-in demo model with random weights, so the first command works anywhere.
#include "infer.hpp"
#include "chat_template.hpp"
#include "command_line.hpp"
#include "hub.hpp"
#include "server.hpp"

#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <unistd.h>

#ifdef INFER_SERVE
int run_serve(int argc, char** argv);  // serve.cpp: the OpenAI-compatible HTTP server
int run_route(int argc, char** argv);  // route.cpp: the router as its own process
#endif
int run_bench(int argc, char** argv);  // bench.cpp: infer bench serve|engine|roofline

namespace {

const char* usage_text = R"(usage:
  infer generate [-m PATH] [-p TEXT | -f FILE] [-n N] [--temp T] [--top-k K] [--top-p P] [--min-p P] [--seed S]
                 [--repetition-penalty R] [--presence-penalty P] [--frequency-penalty F] [--ignore-eos]
                 [-t THREADS] [-c CONTEXT] [--tokenizer FILE] [--prompt-ids 1,2,3] [--ids] [--device cpu|cuda] [--no-mmap]
                 [--cache-type f32|f16|bf16] [--warmup]
                 [--spec ngram|draft] [--draft-model PATH] [--spec-k K] [--spec-ngram N]
  infer logits -m PATH --tokens 1,2,3 --out FILE [-t THREADS] [--tokenizer FILE]
  infer tokenize -m PATH [--special]            stdin {"text": ...} lines -> {"ids": [...]} lines
  infer detokenize -m PATH                      stdin {"ids": [...]} lines -> {"text": ...} lines
  infer render-chat -m PATH [--chat-template FILE_OR_NAME]
                                                stdin {"messages": [...], "add_generation_prompt": true} lines
                                                -> {"text": ..., "ids": [...]} or {"error": ...} lines
  infer chat -m PATH [--chat-template FILE_OR_NAME] [--system TEXT] [--temp T ...as generate]
  infer run-batch -m PATH -i IN.jsonl -o OUT.jsonl [--policy continuous|static] [--max-batch-tokens N]
                  [--max-seqs N] [--kv-memory BYTES | --kv-blocks N] [--block-size B] [--no-prefix-cache]
                  [--trace FILE] [--chat-template FILE_OR_NAME] [-t THREADS] [--device cpu|cuda] [--no-mmap]
                  [--spec ngram|draft] [--draft-model PATH] [--spec-k K] [--spec-ngram N] [--cache-type f32|f16|bf16]
  infer serve [-m PATH] [--host 127.0.0.1] [--port 8080] [--instances N] [--route round-robin|least-loaded|prefix]
              [--max-queue N] [--api-key KEY] [--served-model-name NAME] [engine options as run-batch]
                                                OpenAI-compatible HTTP server (infer serve --help for all options)
  infer route --port P --upstream URL [--upstream URL ...] [--policy round-robin|least-loaded|prefix]
                                                the router as a proxy in front of several infer serve processes
  infer bench serve --url URL [--rate R|inf|R1,R2,..] [--concurrency C] [--num-prompts N] [--slo ttft:MS,tpot:MS]
                    [--json FILE] [--svg DIR] ...   load generator, serving metrics as vLLM's (infer bench --help)
  infer bench engine -m PATH [--batch 1,4,16] [--input-len I] [--output-len O] [--spec ...]
                                                the engine in process, no HTTP
  infer bench roofline -m PATH                  memory bandwidth, peak FLOP/s, and the model's passes under them
  infer make-model -o DIR|FILE.gguf [--dim D] [--layers L] [--heads H] [--kv-heads K] [--ffn F] [--vocab V]
                   [--context C] [--dtype f32|bf16|f16] [--seed S] [--tied]
  infer quantize -m MODEL -o OUT.gguf --type TYPE [--pure] [-t THREADS]
                                                MODEL (a Hugging Face folder or a float GGUF) as a GGUF with
                                                its matrices quantized; TYPE: F32 F16 BF16 Q8_0 Q4_0 Q4_1 Q5_0 Q5_1
                                                Q2_K Q3_K_S Q3_K_M Q3_K_L Q4_K_S Q4_K_M Q5_K_S Q5_K_M Q6_K
                                                (--pure: no per-tensor exceptions)
  infer pull ORG/NAME[:QUANT|/FILE]             downloads from the Hugging Face hub into its cache, prints the path

  -m PATH   a Hugging Face folder (config.json + *.safetensors), a .gguf file, or a llama2.c .bin
            (its tokenizer: --tokenizer FILE, default tokenizer.bin beside it)
  -m hf:ORG/NAME[:QUANT|/FILE]   a model on the Hugging Face hub, pulled first (infer pull --help); also
            llama.cpp's -hf ORG/NAME[:QUANT] and -hff FILE
  -t N      threads for the matmuls (default: all cores). The CPU kernels are chosen from CPUID (avx512, avx2
            or portable); INFER_KERNELS=NAME in the environment picks one by hand
  --bf16-activations   (generate; INFER_BF16_ACTIVATIONS=1 for every command) BF16 weights multiply activations
            rounded to bf16, as llama.cpp does: twice the prefill speed with AVX512_BF16, logits within ~1e-2
  -c N      run the model at N positions at most: bounds prompt + output and the KV cache (default: the model's;
            generate, chat, logits, run-batch, serve)
  tokenize/detokenize/render-chat take a model (folder, .gguf, .bin) or just its tokenizer: a folder holding
  tokenizer.json (+ tokenizer_config.json), a tokenizer.json, a .gguf or a llama2.c tokenizer.bin.
  --chat-template: a file, or a built-in name: chatml, llama3, llama2.
  --spec    speculative decoding, exact: ngram guesses the --spec-k (default 4) ids that followed the last
            --spec-ngram (default 3, then fewer) ids where they occurred before; draft has a smaller model with the
            same vocabulary (--draft-model PATH) guess them. The target verifies all of them in one step.

  Options also answer to llama.cpp's spellings: --model, --prompt, --file, --threads, --n-predict, --ctx-size,
  -s (--seed), --repeat-penalty, --temperature, -sys (--system). infer --version prints the version.
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
            infer::fail("option ", option, ": \"", item, "\" is not a token id");
        ids.push_back(static_cast<int>(id));
    }
    if (ids.empty()) infer::fail("option ", option, " needs at least one token id");
    return ids;
}

int thread_count(const CommandLine& options) {
    long long threads = options.integer("-t", 0);
    if (threads < 0 || threads > 1024) infer::fail("option -t: ", threads, " threads is out of range (1..1024, 0 = all cores)");
    return static_cast<int>(threads);
}

infer::Model load(const CommandLine& options, infer::LayerTimes& times) {
    infer::Stopwatch clock;
    infer::Model model = model_option(options);
    apply_context_option(model, options);
    times.load = clock.seconds();
    return model;
}

void print_json_ids(std::ostream& out, const char* name, const std::vector<int>& ids) {
    out << '"' << name << "\":[";
    for (size_t i = 0; i < ids.size(); ++i) out << (i ? "," : "") << ids[i];
    out << ']';
}

// The prompt: -p TEXT, or the contents of -f FILE (llama.cpp's --file).
std::string prompt_text(const CommandLine& options) {
    if (options.has("-f")) {
        if (options.has("-p")) infer::fail("give the prompt with -p or with -f, not both");
        return infer::read_text_file(options.text("-f"));
    }
    return options.text("-p");
}

// The sampling options of generate and chat, with llama.cpp's defaults for a command-line run.
infer::SamplingParams sampling_params(const CommandLine& options) {
    infer::SamplingParams params;
    params.temperature = static_cast<float>(options.number("--temp", 0.8));
    params.top_k = static_cast<int>(options.integer("--top-k", 40));
    params.top_p = static_cast<float>(options.number("--top-p", 0.95));
    params.min_p = static_cast<float>(options.number("--min-p", 0.05));
    params.repetition_penalty = static_cast<float>(options.number("--repetition-penalty", 1.0));
    params.presence_penalty = static_cast<float>(options.number("--presence-penalty", 0.0));
    params.frequency_penalty = static_cast<float>(options.number("--frequency-penalty", 0.0));
    long long max_tokens = options.integer("-n", 256);
    if (max_tokens < 0 || max_tokens > std::numeric_limits<int>::max()) infer::fail("option -n: ", max_tokens, " is out of range");
    params.max_tokens = static_cast<int>(max_tokens);
    params.ignore_eos = options.has("--ignore-eos");
    if (options.has("--seed")) params.seed = static_cast<uint64_t>(options.integer("--seed", 0));
    params.validate();

    return params;
}

// One request through `engine` to its end (generate and chat), its text streamed to on_text as the steps complete it.
// A command-line run stops where the context ends rather than refusing -n past it (generate says so). Times: prefill
// is the first step, decode the rest; sample and detokenize are the steps' own shares of them.
infer::RequestResult run_request(infer::Engine& engine, const std::vector<int>& prompt_ids, infer::SamplingParams params,
                                 const std::function<void(std::string_view)>& on_text, infer::LayerTimes& times) {
    const infer::Model& model = engine.model();
    const int64_t room = int64_t{model.config.context_length} - static_cast<int64_t>(prompt_ids.size());
    if (room <= 0)
        infer::fail("the prompt is ", prompt_ids.size(), " tokens, but the model's context holds ", model.config.context_length,
                    " (", model.source, "); shorten the prompt");
    if (params.max_tokens > room) params.max_tokens = static_cast<int>(room);
    const int id = engine.add_request(prompt_ids, params);
    infer::Stopwatch clock;
    bool first = true;
    while (engine.has_work()) {
        const int64_t steps = engine.totals().steps;
        for (const infer::Event& event : engine.step()) {
            if (event.error.size()) infer::fail(event.error);
            if (on_text) on_text(event.text);
        }
        (first ? times.prefill : times.decode) += clock.seconds();
        if (engine.totals().steps > steps) {
            times.sample += engine.steps().back().sample;
            times.detokenize += engine.steps().back().detokenize;
        }
        clock.restart();
        first = false;
    }
    std::optional<infer::RequestResult> done = engine.take_result(id);
    if (!done) infer::fail("the request did not finish");
    return std::move(*done);
}

// The engine of generate and chat: one sequence at a time, a pool for one whole context, the KV cache's type, the
// device and speculative decoding as the options ask.
infer::EngineConfig command_line_engine(const infer::Model& model, const CommandLine& options, infer::Device device,
                                        const infer::SpecConfig& spec) {
    infer::EngineConfig config;
    config.device = device;
    config.spec = spec;
    config.kv_dtype = cache_type(options);
    config.scheduler.max_seqs = 1;
    config.num_blocks = (model.config.context_length + config.block_size - 1) / config.block_size;
    return config;
}

// generate: the request through an Engine, the engine infer serve and run-batch run. `result_out` receives the engine's
// record (its speculative counts). With `warmup`, the same prompt runs once untimed in this engine first, so the
// timed prefill finds its buffers, KV blocks and pages already touched (as llama-bench's warm-up leaves its context);
// prefix caching is off then, since it would hand the timed request the warm-up's blocks.
infer::GenerationResult generate_with_engine(const infer::Model& model, infer::ThreadPool& pool, const CommandLine& options,
                                             const infer::SamplingParams& params, const std::function<void(std::string_view)>& stream,
                                             infer::Device device, const infer::SpecConfig& spec, infer::RequestResult& result_out,
                                             bool warmup) {
    infer::EngineConfig config = command_line_engine(model, options, device, spec);
    if (warmup) config.prefix_caching = false;
    infer::Engine engine(model, pool, config);
    const bool given_ids = options.has("--prompt-ids");
    const std::string prompt = given_ids ? std::string{} : prompt_text(options);
    infer::GenerationResult result;
    infer::Stopwatch tokenize_clock;
    if (given_ids) result.prompt_ids = parse_ids("--prompt-ids", options.text("--prompt-ids"));
    else if (engine.tokenizer()) result.prompt_ids = engine.tokenizer()->encode(prompt);
    else infer::fail(model.source, ": the model has no tokenizer to encode a text prompt; give --prompt-ids");
    result.times.tokenize = given_ids ? 0.0 : tokenize_clock.seconds();
    if (warmup) {
        infer::SamplingParams one = params;
        one.max_tokens = 1;
        infer::LayerTimes untimed;
        run_request(engine, result.prompt_ids, one, {}, untimed);
    }
    // The prompt is echoed with the first generated text, not before: a run that fails (a prompt longer than the
    // context, say) prints its error and nothing on stdout.
    bool echoed = given_ids || options.has("--ids");
    auto echo_then_stream = [&](std::string_view text) {
        if (!echoed) std::cout << prompt;
        echoed = true;
        stream(text);
    };
    result_out = run_request(engine, result.prompt_ids, params, echo_then_stream, result.times);
    if (!echoed) std::cout << prompt;
    result.generated_ids = result_out.generated_ids;
    result.text = result_out.text;
    result.finish_reason = result_out.finish_reason;
    result.seed = result_out.seed;
    return result;
}

int run_generate(const CommandLine& options) {
    if (options.has("--bf16-activations")) {
        if (options.text("--device", "cpu") != "cpu") infer::fail("option --bf16-activations: the CPU kernels' option, not --device ", options.text("--device"));
        infer::use_bf16_activations(true);
        if (infer::cpu_kernels() != infer::CpuKernels::Avx512 || !infer::detail::cpu_runs_bf16_avx512())
            std::cerr << "note: --bf16-activations runs the portable loop here (its fast kernel needs AVX-512 with AVX512_BF16): "
                         "the same logits, slower\n";
    }
    infer::LayerTimes load_times;
    infer::Model model;
    if (options.has("-m")) {
        model = load(options, load_times);
    } else {
        infer::Stopwatch clock;
        model = infer::demo_model();
        apply_context_option(model, options);
        load_times.load = clock.seconds();
        std::cerr << "note: no -m given, so this runs the built-in demo model: random weights and a byte vocabulary.\n"
                     "      Its output is meaningless. Load a real checkpoint with -m (see README.md), e.g.\n"
                     "      infer generate -m hf:ggml-org/models/tinyllamas/stories15M-q4_0.gguf -p \"Once upon a time\"\n";
    }
    infer::SamplingParams params = sampling_params(options);
    infer::ThreadPool pool(thread_count(options));
    const bool ids_only = options.has("--ids");
    auto stream = [&](std::string_view text) {
        if (!ids_only) std::cout << text << std::flush;
    };
    infer::GenerationResult result;
    infer::RequestResult engine_result;  // the engine's record, when the engine ran the request
    const infer::Device device = infer::parse_device(options.text("--device", "cpu"));
    const infer::SpecConfig spec = spec_config(options);
    result = generate_with_engine(model, pool, options, params, stream, device, spec, engine_result, options.has("--warmup"));
    const size_t asked = static_cast<size_t>(params.max_tokens);
    if (result.finish_reason == infer::FinishReason::Length && result.generated_ids.size() < asked)
        std::cerr << "warning: stopped after " << result.generated_ids.size() << " of the " << asked
                  << " tokens -n asked for: the prompt and the output filled the model's context of "
                  << model.config.context_length << " tokens\n";
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
    const std::string where_it_ran = device == infer::Device::Cuda
                                         ? std::string("cuda")
                                         : std::string("cpu, ") + infer::cpu_kernels_name(infer::cpu_kernels()) + " kernels" +
                                               (infer::bf16_activations() ? ", bf16 activations" : "");
    auto per_second = [](double count, double seconds) { return seconds > 0 ? count / seconds : 0.0; };
    std::fprintf(stderr,
                 "\nprompt: %zu tokens, generated: %zu tokens (finish: %s, seed %llu)\n"
                 "prefill: %.1f tokens/s   decode: %.1f tokens/s   (%s)\n"
                 "time by layer (ms): load %.1f | tokenize %.2f | prefill %.1f | decode %.1f | sample %.2f | detokenize %.2f\n",
                 result.prompt_ids.size(), result.generated_ids.size(), infer::finish_reason_name(result.finish_reason),
                 static_cast<unsigned long long>(result.seed), per_second(static_cast<double>(result.prompt_ids.size()), t.prefill),
                 per_second(static_cast<double>(decode_steps), t.decode), where_it_ran.c_str(), load_times.load * 1e3, t.tokenize * 1e3,
                 t.prefill * 1e3, t.decode * 1e3, t.sample * 1e3, t.detokenize * 1e3);
    if (spec.enabled()) {
        const infer::RequestResult& r = engine_result;
        std::fprintf(stderr, "speculative (%s, k %d): %d drafted, %d accepted (%.1f%%), %.2f tokens per verifying step (%d steps)\n",
                     infer::spec_method_name(spec.method), spec.k, r.draft_tokens, r.accepted_tokens,
                     r.draft_tokens > 0 ? 100.0 * r.accepted_tokens / r.draft_tokens : 0.0,
                     r.draft_steps > 0 ? static_cast<double>(r.accepted_tokens + r.draft_steps) / r.draft_steps : 0.0, r.draft_steps);
    }
    return 0;
}

int run_logits(const CommandLine& options) {
    if (!options.has("-m")) infer::fail("infer logits needs -m PATH");
    if (!options.has("--tokens")) infer::fail("infer logits needs --tokens 1,2,3");
    if (!options.has("--out")) infer::fail("infer logits needs --out FILE");
    infer::LayerTimes times;
    infer::Model model = load(options, times);
    std::vector<int> tokens = parse_ids("--tokens", options.text("--tokens"));
    const int n = static_cast<int>(tokens.size());
    if (n > model.config.context_length)
        infer::fail("--tokens has ", n, " tokens, but the model's context holds ", model.config.context_length);
    infer::ThreadPool pool(thread_count(options));
    infer::KVCache cache(model.config, (n + 15) / 16, 16);
    cache.reserve(0, n);
    infer::Batch batch;
    for (int i = 0; i < n; ++i) batch.add(tokens[i], i, 0, true);
    infer::ForwardPass forward(model, pool);
    std::span<const float> logits = forward.forward(batch, cache);
    std::ofstream out(options.text("--out"), std::ios::binary);
    if (!out) infer::fail(options.text("--out"), ": cannot create");
    out.write(reinterpret_cast<const char*>(logits.data()), static_cast<std::streamsize>(logits.size_bytes()));
    infer::close_written_file(out, options.text("--out"));
    std::cerr << "wrote " << n << " x " << model.config.vocab_size << " float32 logits to " << options.text("--out") << '\n';
    return 0;
}

// ---- Tokenizer commands: JSON lines in, JSON lines out -----------------------------------------------------------

// A model path or a tokenizer-only path. A llama2.c model and its tokenizer.bin are both plain .bin files: a file
// whose size matches a llama2.c header exactly is a model (whose tokenizer is --tokenizer or tokenizer.bin beside it).
infer::Tokenizer open_tokenizer(const CommandLine& options) {
    if (!options.has("-m")) infer::fail("this command needs -m PATH (a model or its tokenizer)");
    const std::filesystem::path path = options.text("-m");
    if (std::filesystem::is_regular_file(path) && path.extension() == ".bin") {
        std::optional<infer::Model> model;
        try {
            model = infer::load_llama2c(path, options.text("--tokenizer"));
        } catch (const infer::Error&) {
            // not a llama2.c model: read it as a tokenizer.bin below
        }
        if (model) return infer::tokenizer_for(*model);
    }
    return infer::load_tokenizer(path);
}

void write_ids(std::ostream& out, const std::vector<int>& ids) {
    out << '[';
    for (size_t i = 0; i < ids.size(); ++i) out << (i ? "," : "") << ids[i];
    out << ']';
}

void write_error_line(const std::string& message) {
    std::cout << "{\"error\":";
    infer::write_json_string(std::cout, message);
    std::cout << "}\n";
}

// Runs `handle` on each JSON line of stdin. A bad line gets an {"error": ...} line and the run goes on; the exit
// code says whether every line succeeded.
template <class Handle>
int for_each_json_line(Handle handle) {
    std::string line;
    int line_number = 0, failures = 0;
    while (std::getline(std::cin, line)) {
        ++line_number;
        if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
        try {
            handle(infer::Json::parse(line, "stdin line " + std::to_string(line_number)));
        } catch (const infer::Error& e) {
            write_error_line(e.what());
            ++failures;
        }
        std::cout.flush();
    }
    return failures == 0 ? 0 : 1;
}

int run_tokenize(const CommandLine& options) {
    infer::Tokenizer tokenizer = open_tokenizer(options);
    const bool special = options.has("--special");
    return for_each_json_line([&](const infer::Json& request) {
        const infer::Json* text = request.find("text");
        if (!text || !text->is_string()) infer::fail("each line needs a string field \"text\"");
        std::cout << "{\"ids\":";
        write_ids(std::cout, tokenizer.encode(text->as_string(), special));
        std::cout << "}\n";
    });
}

int run_detokenize(const CommandLine& options) {
    infer::Tokenizer tokenizer = open_tokenizer(options);
    return for_each_json_line([&](const infer::Json& request) {
        const infer::Json* ids = request.find("ids");
        if (!ids || !ids->is_array()) infer::fail("each line needs an array field \"ids\"");
        std::vector<int> list;
        for (const infer::Json& id : ids->as_array()) {
            if (!id.is_number() || id.as_number() != std::floor(id.as_number()) || id.as_number() < 0 ||
                id.as_number() >= tokenizer.vocab_size())
                infer::fail("\"ids\" holds a value that is not a token id of this vocabulary (",
                                    tokenizer.vocab_size(), " tokens)");
            list.push_back(static_cast<int>(id.as_int()));
        }
        std::cout << "{\"text\":";
        infer::write_json_string(std::cout, tokenizer.decode(list));
        std::cout << "}\n";
    });
}

// The template to render with: --chat-template (a built-in name or a file), else the tokenizer's own.
std::string chat_template_source(const CommandLine& options, const infer::Tokenizer& tokenizer) {
    return serve::chat_template_source(options.text("--chat-template"), tokenizer);
}

using serve::template_variables;

int run_render_chat(const CommandLine& options) {
    infer::Tokenizer tokenizer = open_tokenizer(options);
    const std::string source = chat_template_source(options, tokenizer);
    const infer::Json variables = template_variables(tokenizer);
    return for_each_json_line([&](const infer::Json& request) {
        const infer::Json* messages = request.find("messages");
        if (!messages || !messages->is_array()) infer::fail("each line needs an array field \"messages\"");
        const infer::Json* generation = request.find("add_generation_prompt");
        bool add_generation_prompt = generation && generation->is_bool() && generation->as_bool();
        std::string text = chat::render(source, *messages, add_generation_prompt, variables);
        // The template writes the special tokens itself, so nothing more is added (apply_chat_template's tokenize).
        std::vector<int> ids = tokenizer.encode(text, false);
        std::cout << "{\"text\":";
        infer::write_json_string(std::cout, text);
        std::cout << ",\"ids\":";
        write_ids(std::cout, ids);
        std::cout << "}\n";
    });
}

// An interactive chat: each line on stdin is a user turn; the reply streams to stdout. The whole conversation is
// rendered again every turn, and the engine's prefix cache finds the earlier turns' blocks, so only the new turn is
// prefilled.
int run_chat(const CommandLine& options) {
    if (!options.has("-m")) infer::fail("infer chat needs -m PATH");
    infer::LayerTimes load_times;
    infer::Model model = load(options, load_times);
    infer::Tokenizer tokenizer = infer::tokenizer_for(model);
    const std::string source = chat_template_source(options, tokenizer);
    const infer::Json variables = template_variables(tokenizer);
    infer::SamplingParams params = sampling_params(options);
    infer::ThreadPool pool(thread_count(options));
    infer::Engine engine(model, pool, command_line_engine(model, options, infer::Device::Cpu, {}));
    infer::Json::Array messages;
    if (options.has("--system"))  // llama.cpp's -sys: the conversation opens with this system message
        messages.push_back(infer::Json(infer::Json::Object{{"role", infer::Json(std::string("system"))},
                                                           {"content", infer::Json(options.text("--system"))}}));
    const bool interactive = ::isatty(0);
    std::string line;
    while (true) {
        if (interactive) std::cerr << "> " << std::flush;
        if (!std::getline(std::cin, line)) break;
        if (line == "/exit" || line == "/quit") break;
        if (line.empty()) continue;
        messages.push_back(infer::Json(infer::Json::Object{{"role", infer::Json(std::string("user"))},
                                                           {"content", infer::Json(line)}}));
        std::string prompt = chat::render(source, infer::Json(messages), true, variables);
        infer::LayerTimes times;
        const infer::RequestResult reply = run_request(engine, tokenizer.encode(prompt, false), params,
                                                       [](std::string_view text) { std::cout << text << std::flush; }, times);
        std::cout << '\n';
        messages.push_back(infer::Json(infer::Json::Object{{"role", infer::Json(std::string("assistant"))},
                                                           {"content", infer::Json(reply.text)}}));
        if (interactive)
            std::cerr << "[" << reply.generated_ids.size() << " tokens, "
                      << (times.decode > 0 ? (reply.generated_ids.size() - 1) / times.decode : 0.0) << " tokens/s]\n";
    }
    return 0;
}

// ---- Offline batch inference: the OpenAI Batch file format through the engine ------------------------------------
// Each input line {"custom_id", "method": "POST", "url": "/v1/completions" | "/v1/chat/completions", "body": {...}}
// becomes one engine request; all run together (continuous batching) and each gets an output line, in input order,
// as vLLM's run-batch writes them. A line that cannot run gets an error line; the others go on.

// One input line: the request (parsed by server.hpp, as `infer serve` parses an HTTP body) or why it cannot run.
struct BatchRequest {
    std::string custom_id;
    serve::CompletionRequest request;
    std::vector<int> engine_ids;  // one engine request per choice ("n"); empty: the line could not run
    std::string error;  // set: this line gets an error line
};

BatchRequest parse_batch_line(const infer::Json& line, const serve::RequestContext& context) {
    BatchRequest r;
    if (const infer::Json* id = line.find("custom_id"); id && id->is_string()) r.custom_id = id->as_string();
    const infer::Json* method = line.find("method");
    if (method && (!method->is_string() || method->as_string() != "POST")) infer::fail("\"method\" must be \"POST\"");
    const infer::Json* url = line.find("url");
    if (!url || !url->is_string()) infer::fail("each line needs a string field \"url\"");
    const bool chat = url->as_string() == "/v1/chat/completions";
    if (!chat && url->as_string() != "/v1/completions")
        infer::fail("url \"", url->as_string(), "\" is not supported (/v1/completions or /v1/chat/completions)");
    const infer::Json* body = line.find("body");
    if (!body || !body->is_object()) infer::fail("each line needs an object field \"body\"");
    r.request = serve::parse_request(*body, chat, context);
    if (r.request.stream) infer::fail("body field \"stream\": a batch line cannot stream");
    return r;
}

void write_batch_error(std::ostream& out, int index, const std::string& custom_id, const std::string& message) {
    out << "{\"id\":\"batch_req_" << index << "\",\"custom_id\":";
    infer::write_json_string(out, custom_id);
    out << ",\"response\":null,\"error\":{\"code\":\"invalid_request\",\"message\":";
    infer::write_json_string(out, message);
    out << "}}\n";
}

void write_batch_result(std::ostream& out, int index, const BatchRequest& r, std::span<const infer::RequestResult> choices,
                        const std::string& model_name, long long created, const infer::Tokenizer* tokenizer) {
    out << "{\"id\":\"batch_req_" << index << "\",\"custom_id\":";
    infer::write_json_string(out, r.custom_id);
    serve::ResponseHead head{(r.request.chat ? "chatcmpl-" : "cmpl-") + std::to_string(index), created,
                             r.request.model.empty() ? model_name : r.request.model, r.request.chat, tokenizer};
    out << ",\"response\":{\"status_code\":200,\"request_id\":\"req_" << index << "\",\"body\":"
        << serve::completion_body(head, serve::make_choices(r.request, choices, head.id), serve::usage_of(r.request, choices))
        << "},\"error\":null}\n";
}

int run_batch(const CommandLine& options) {
    for (const char* needed : {"-m", "-i", "-o"})
        if (!options.has(needed)) infer::fail("infer run-batch needs ", needed, " (see infer --help)");
    infer::LayerTimes load_times;
    infer::Model model = load(options, load_times);
    std::optional<infer::Tokenizer> tokenizer;
    if (infer::has_tokenizer(model)) tokenizer = infer::tokenizer_for(model);

    infer::EngineConfig config = engine_config(options);
    if (options.has("--trace")) config.step_history = 0;  // the trace shows every step of the run
    const std::string policy = options.text("--policy", "continuous");
    infer::ThreadPool pool(thread_count(options));
    infer::Engine engine(model, pool, config, tokenizer ? &*tokenizer : nullptr);

    std::ifstream in(options.text("-i"));
    if (!in) infer::fail(options.text("-i"), ": cannot open");
    // The chat template is looked up at the first chat line, so a completions-only file needs none.
    std::optional<std::string> template_source;
    auto render_chat = [&](const infer::Json& messages, bool add_generation_prompt, const infer::Json& extra) {
        if (!template_source) template_source = chat_template_source(options, *tokenizer);
        return chat::render(*template_source, messages, add_generation_prompt, serve::merged(template_variables(*tokenizer), extra));
    };
    serve::GrammarCache grammars(tokenizer ? &*tokenizer : nullptr);
    std::vector<BatchRequest> requests;
    std::string line;
    int line_number = 0;
    while (std::getline(in, line)) {
        ++line_number;
        if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
        BatchRequest request;
        try {
            infer::Json json = infer::Json::parse(line, "line " + std::to_string(line_number));
            if (const infer::Json* id = json.find("custom_id"); id && id->is_string()) request.custom_id = id->as_string();
            try {
                request = parse_batch_line(json, {&model, tokenizer ? &*tokenizer : nullptr, render_chat, tokenizer ? &grammars : nullptr});
            } catch (const infer::Error& e) {
                request.error = "line " + std::to_string(line_number) + ": " + e.what();
            }
        } catch (const infer::Error& e) {  // the parser's message names the line and byte
            request.error = e.what();
        }
        if (request.error.empty())
            for (const std::vector<int>& prompt : request.request.prompts)
                for (int sample = 0; sample < request.request.best_of; ++sample) {  // as infer serve: a seed gives each its own
                    infer::SamplingParams params = request.request.params;
                    if (params.seed) params.seed = *params.seed + static_cast<uint64_t>(sample);
                    request.engine_ids.push_back(engine.add_request(prompt, params, request.request.stop));
                }
        requests.push_back(std::move(request));
    }

    const bool show_progress = ::isatty(2);
    infer::Stopwatch wall;
    size_t done = 0, running_total = 0;
    for (const BatchRequest& r : requests) running_total += r.engine_ids.size();
    std::unordered_map<int, infer::RequestResult> results;
    while (engine.has_work()) {
        for (const infer::Event& e : engine.step()) {
            if (!e.finished) continue;
            results[e.request_id] = *engine.take_result(e.request_id);
            ++done;
            if (show_progress || done == running_total)
                std::fprintf(stderr, "\r[run-batch] %zu/%zu requests done, %lld steps, %.1f s", done, running_total,
                             static_cast<long long>(engine.totals().steps), wall.seconds());
        }
    }
    const double seconds = wall.seconds();
    if (running_total > 0) std::fprintf(stderr, "\n");

    std::ofstream out(options.text("-o"));
    if (!out) infer::fail(options.text("-o"), ": cannot create");
    const long long created = std::chrono::duration_cast<std::chrono::seconds>(
                                  std::chrono::system_clock::now().time_since_epoch()).count();
    const std::string model_name = std::filesystem::path(options.text("-m")).filename().string();
    size_t failed = 0, prompt_tokens = 0, generated = 0;
    std::vector<infer::RequestResult> finished;
    for (size_t i = 0; i < requests.size(); ++i) {
        const BatchRequest& r = requests[i];
        const int index = static_cast<int>(i);
        if (r.engine_ids.empty()) {
            write_batch_error(out, index, r.custom_id, r.error);
            ++failed;
            continue;
        }
        std::vector<infer::RequestResult> choices;
        for (int id : r.engine_ids) choices.push_back(results.at(id));
        finished.insert(finished.end(), choices.begin(), choices.end());
        auto error = std::find_if(choices.begin(), choices.end(), [](const auto& c) { return c.finish_reason == infer::FinishReason::Error; });
        if (error != choices.end()) {
            write_batch_error(out, index, r.custom_id, error->error);
            ++failed;
            continue;
        }
        write_batch_result(out, index, r, choices, model_name, created, tokenizer ? &*tokenizer : nullptr);
        prompt_tokens += serve::usage_of(r.request, choices).prompt;
        for (const infer::RequestResult& choice : choices) generated += choice.generated_ids.size();
    }
    infer::close_written_file(out, options.text("-o"));

    if (options.has("--trace")) {
        std::ofstream trace(options.text("--trace"));
        if (!trace) infer::fail(options.text("--trace"), ": cannot create");
        infer::write_chrome_trace(trace, engine.steps(), finished);
        infer::close_written_file(trace, options.text("--trace"));
    }
    const infer::EngineTotals& t = engine.totals();
    auto per_second = [&](double count) { return seconds > 0 ? count / seconds : 0.0; };
    std::fprintf(stderr,
                 "requests: %zu (%zu failed)   policy: %s   max_batch_tokens %d   max_seqs %d   KV: %d blocks of %d tokens\n"
                 "tokens: %zu prompt + %zu generated in %.2f s   throughput: %.1f generated tokens/s, %.1f total tokens/s\n"
                 "steps: %lld   preemptions: %lld   prefix cache: %lld of %lld prompt tokens hit (%.1f%%)\n",
                 requests.size(), failed, policy.c_str(), config.scheduler.max_batch_tokens, config.scheduler.max_seqs,
                 engine.cache().num_blocks(), engine.cache().block_size(), prompt_tokens, generated, seconds,
                 per_second(static_cast<double>(generated)), per_second(static_cast<double>(prompt_tokens + generated)),
                 static_cast<long long>(t.steps), static_cast<long long>(t.preemptions),
                 static_cast<long long>(t.prefix_hit_tokens), static_cast<long long>(t.prompt_tokens),
                 t.prompt_tokens > 0 ? 100.0 * static_cast<double>(t.prefix_hit_tokens) / static_cast<double>(t.prompt_tokens) : 0.0);
    if (config.spec.enabled())
        std::fprintf(stderr, "speculative (%s, k %d): %lld drafted, %lld accepted (%.1f%%)\n", infer::spec_method_name(config.spec.method),
                     config.spec.k, static_cast<long long>(t.draft_tokens), static_cast<long long>(t.accepted_tokens),
                     t.draft_tokens > 0 ? 100.0 * static_cast<double>(t.accepted_tokens) / static_cast<double>(t.draft_tokens) : 0.0);
    return 0;
}

int run_make_model(const CommandLine& options) {
    if (!options.has("-o")) infer::fail("infer make-model needs -o DIR");
    infer::ModelShape shape;
    auto dimension = [&](const char* name, int fallback) {
        long long value = options.integer(name, fallback);
        if (value <= 0 || value > (1 << 20)) infer::fail("option ", name, ": ", value, " is out of range (1..1048576)");
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
    const infer::DType dtype = float_type("--dtype", dtype_text);
    const std::filesystem::path out = options.text("-o");
    const uint64_t seed = static_cast<uint64_t>(options.integer("--seed", 0));
    if (out.extension() == ".gguf") infer::save_random_model_gguf(out, shape, dtype, seed);  // one file, for infer quantize
    else infer::save_random_model(out, shape, dtype, seed);                                   // a Hugging Face folder
    infer::Model check = infer::load_model(options.text("-o"));  // read it back: what we wrote must load
    std::cerr << "wrote " << options.text("-o") << ": " << check.parameter_count() << " parameters in " << dtype_text
              << "; a decode step reads " << check.weight_bytes_per_token() / 1e6 << " MB of them\n";
    return 0;
}

// A Hugging Face folder or a float GGUF to a quantized GGUF, with a progress line on stderr (rewritten in place on a
// terminal) and a note for whatever the output could not keep.
int run_quantize(const CommandLine& options) {
    if (!options.has("-m") || !options.has("-o") || !options.has("--type"))
        infer::fail("infer quantize needs -m MODEL -o OUT.gguf --type TYPE (e.g. Q4_K_M); MODEL: a Hugging Face folder or a float GGUF");
    const std::filesystem::path in = options.text("-m"), out = options.text("-o");
    if (!std::filesystem::exists(in)) infer::fail(in.string(), ": no such file or folder");
    infer::ThreadPool pool(thread_count(options));
    infer::QuantizeOptions quantize;
    quantize.type = options.text("--type");
    quantize.pure = options.has("--pure");
    quantize.pool = &pool;
    const bool terminal = isatty(STDERR_FILENO);
    quantize.progress = [terminal](size_t done, size_t total, uint64_t bytes, const std::string& name) {
        const int width = 30, filled = static_cast<int>(width * done / std::max<size_t>(total, 1));
        std::fprintf(stderr, "%s[%s%s] %zu/%zu tensors, %.1f MB  %-40s%s", terminal ? "\r" : "",
                     std::string(static_cast<size_t>(filled), '#').c_str(), std::string(static_cast<size_t>(width - filled), ' ').c_str(),
                     done, total, static_cast<double>(bytes) / 1e6, name.c_str(), terminal && done < total ? "" : "\n");
    };
    infer::Stopwatch clock;
    const infer::QuantizeReport report = infer::quantize_model(in, out, quantize);
    for (const std::string& note : report.notes) std::fprintf(stderr, "note: %s\n", note.c_str());
    std::string types;
    for (const auto& [type, count] : report.tensors_by_type) types += (types.empty() ? "" : ", ") + std::to_string(count) + " " + type;
    std::fprintf(stderr, "wrote %s: %.1f MB from %.1f MB (%.2fx smaller) in %.1f s; tensors: %s\n", out.c_str(),
                 static_cast<double>(report.bytes_out) / 1e6, static_cast<double>(report.bytes_in) / 1e6,
                 static_cast<double>(report.bytes_in) / static_cast<double>(std::max<uint64_t>(report.bytes_out, 1)),
                 clock.seconds(), types.c_str());
    return 0;
}

}  // namespace

int run_command(int argc, char** argv) {
    try {
        std::string command = argc > 1 ? argv[1] : "";
        if (command == "pull") return hub::run_pull(argc, argv);
        // -m hf:ORG/NAME[:QUANT|/FILE], -hf ORG/NAME[:QUANT] and -hff FILE become -m LOCAL_PATH (pulled first).
        std::vector<std::string> resolved = hub::resolve_model_arguments({argv, argv + argc}, hub::Settings::from_environment());
        std::vector<char*> resolved_argv;
        for (std::string& arg : resolved) resolved_argv.push_back(arg.data());
        resolved_argv.push_back(nullptr);
        argc = static_cast<int>(resolved.size());
        argv = resolved_argv.data();
        if (command == "generate")
            return run_generate(CommandLine(argc, argv, 2,
                                        {"-m", "-p", "-f", "-n", "-c", "--temp", "--top-k", "--top-p", "--min-p", "--seed", "-t",
                                         "--repetition-penalty", "--presence-penalty", "--frequency-penalty",
                                         "--tokenizer", "--prompt-ids", "--device", "--spec", "--draft-model", "--spec-k",
                                         "--spec-ngram", "--cache-type", "--cache-type-k", "--cache-type-v"},
                                        {"--ignore-eos", "--ids", "--no-mmap", "--bf16-activations", "--warmup"}, usage_text));
        if (command == "tokenize")
            return run_tokenize(CommandLine(argc, argv, 2, {"-m", "--tokenizer"}, {"--special"}, usage_text));
        if (command == "detokenize")
            return run_detokenize(CommandLine(argc, argv, 2, {"-m", "--tokenizer"}, {}, usage_text));
        if (command == "render-chat")
            return run_render_chat(CommandLine(argc, argv, 2, {"-m", "--tokenizer", "--chat-template"}, {}, usage_text));
        if (command == "chat")
            return run_chat(CommandLine(argc, argv, 2,
                                        {"-m", "-n", "-c", "--temp", "--top-k", "--top-p", "--min-p", "--seed", "-t",
                                         "--repetition-penalty", "--presence-penalty", "--frequency-penalty",
                                         "--tokenizer", "--chat-template", "--system"},
                                        {"--ignore-eos"}, usage_text));
        if (command == "logits")
            return run_logits(CommandLine(argc, argv, 2, {"-m", "--tokens", "--out", "-t", "-c", "--tokenizer"}, {}, usage_text));
        if (command == "run-batch")
            return run_batch(CommandLine(argc, argv, 2,
                                         {"-m", "-i", "-o", "--policy", "--max-batch-tokens", "--max-seqs", "--kv-memory",
                                          "--kv-blocks", "--block-size", "--trace", "-t", "--tokenizer", "--chat-template",
                                          "--device", "-c", "--spec", "--draft-model", "--spec-k", "--spec-ngram",
                                          "--cache-type", "--cache-type-k", "--cache-type-v"},
                                         {"--no-prefix-cache", "--no-mmap"}, usage_text));
        if (command == "serve" || command == "route") {
#ifdef INFER_SERVE
            return command == "serve" ? run_serve(argc, argv) : run_route(argc, argv);
#else
            infer::fail("infer ", command, " is not built: it needs cpp-httplib and nlohmann-json "
                                "(Debian: apt-get install libcpp-httplib-dev nlohmann-json3-dev), then meson setup --reconfigure");
#endif
        }
        if (command == "bench") return run_bench(argc, argv);
        if (command == "make-model")
            return run_make_model(CommandLine(argc, argv, 2,
                                          {"-o", "--dim", "--layers", "--heads", "--kv-heads", "--ffn", "--vocab",
                                           "--context", "--dtype", "--seed"},
                                          {"--tied"}, usage_text));
        if (command == "quantize")
            return run_quantize(CommandLine(argc, argv, 2, {"-m", "-o", "--type", "-t"}, {"--pure"}, usage_text));
        if (command == "--version" || command == "version") {
            std::cout << "infer " << INFER_VERSION_STRING << '\n';
            return 0;
        }
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

// The weights are mapped from the model file: if that file is truncated or rewritten while infer runs, the next touch
// of a vanished page raises SIGBUS. Say what happened instead of dying without a word (--no-mmap avoids it).
extern "C" void on_bus_error(int) {
    static const char message[] =
        "error: the model file changed or was truncated while infer was using it (SIGBUS); "
        "run with --no-mmap to read the weights into memory instead of mapping the file\n";
    [[maybe_unused]] ssize_t written = ::write(STDERR_FILENO, message, sizeof message - 1);
    ::_exit(1);
}

int main(int argc, char** argv) {
    std::signal(SIGBUS, on_bus_error);
    const int status = run_command(argc, argv);
    // Standard output is buffered: a full disk or a closed pipe may show only now, and a run whose output was lost
    // must not exit 0 (`infer generate ... > /dev/full`).
    std::cout.flush();
    if (status == 0 && (!std::cout || std::fflush(stdout) != 0)) {
        std::cerr << "error: writing the standard output failed (" << std::strerror(errno) << ")\n";
        return 1;
    }
    return status;
}
