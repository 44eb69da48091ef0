// bench_batch — the scheduler's benchmark: `infer run-batch` on a mixed workload under each policy, and the engine's
// aggregate decode rate at a given number of running sequences.
//
//   bench_batch INFER_BINARY [--model DIR] [--requests N] [--max-seqs N] [--seed S] [-t THREADS] [--repeats R]
//
// The workload: N requests (default 64) with prompts of 16–256 token ids and max_tokens of
// 8–256, greedy, ignoring EOS so every policy does exactly the same work. It is written as an OpenAI Batch file and
// run through `infer run-batch` three ways: one request at a time (--max-seqs 1), static batching and continuous
// batching (--max-seqs N). Without --model it first writes a 110M-parameter make-model model (the shape of llama2.c's
// stories110M: dim 768, 12 layers, 12 heads, ffn 2048, vocab 32000, classifier tied) into a temporary folder.
// Figures are wall-clock on whatever else the machine is doing: compare the ratios within one run. With --repeats R
// the static and continuous runs alternate R times each and keep their fastest, so that a minute in which the host is
// busier falls on both policies rather than on one.
//   meson test -C build --benchmark --verbose
#include "command_line.hpp"
#include "infer.hpp"

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <random>
#include <unistd.h>

namespace {

struct Options {
    std::string infer_binary, model_dir;
    int requests = 64;
    int max_seqs = 16;
    uint64_t seed = 2026;
    int threads = 0;
    int repeats = 1;
};

Options parse_options(int argc, char** argv) {
    const char* usage =
        "usage: bench_batch INFER_BINARY [--model DIR] [--requests N] [--max-seqs N] [--seed S] [-t THREADS] [--repeats R]\n";
    if (argc < 2 || argv[1][0] == '-') throw infer::Error(std::string("missing INFER_BINARY\n") + usage);
    CommandLine line(argc, argv, 2, {"--model", "--requests", "--max-seqs", "--seed", "-t", "--repeats"}, {}, usage);
    Options options;
    options.infer_binary = argv[1];
    options.model_dir = line.text("--model");
    options.requests = static_cast<int>(line.integer("--requests", options.requests, 1, 100000));
    options.max_seqs = static_cast<int>(line.integer("--max-seqs", options.max_seqs, 1, 4096));
    options.seed = static_cast<uint64_t>(line.integer("--seed", 2026, 0, std::numeric_limits<long long>::max()));
    options.threads = static_cast<int>(line.integer("-t", options.threads, 0, 1024));
    options.repeats = static_cast<int>(line.integer("--repeats", options.repeats, 1, 100));
    return options;
}

// The workload as OpenAI Batch lines; prompts are token ids, which /v1/completions accepts as a list.
void write_workload(const std::filesystem::path& path, const Options& options, int vocab) {
    std::mt19937_64 rng(options.seed);
    std::ofstream out(path);
    for (int i = 0; i < options.requests; ++i) {
        int prompt_length = 16 + static_cast<int>(rng() % 241);
        int max_tokens = 8 + static_cast<int>(rng() % 249);
        out << "{\"custom_id\": \"r" << i << "\", \"method\": \"POST\", \"url\": \"/v1/completions\", \"body\": {\"prompt\": [1";
        for (int k = 1; k < prompt_length; ++k) out << ", " << 3 + static_cast<int>(rng() % static_cast<uint64_t>(vocab - 3));
        out << "], \"max_tokens\": " << max_tokens << ", \"temperature\": 0, \"ignore_eos\": true}}\n";
    }
    infer::close_written_file(out, path.string());
}

struct BatchRun {
    double seconds = 0;  // the engine's run, as run-batch reports it: not the process's start, load and writing
    long long generated = 0, steps = 0;
    std::vector<std::string> outputs;  // each line's completion text, to check the policies agree
};

// Runs `infer run-batch` and reads back its output lines (usage.completion_tokens) and its summary (the engine's
// seconds, as vLLM's throughput benchmark times only the generation, and its steps).
BatchRun run_batch(const Options& options, const std::filesystem::path& folder, const std::filesystem::path& model,
                   const std::string& policy, int max_seqs) {
    const std::filesystem::path output = folder / ("out-" + policy + "-" + std::to_string(max_seqs) + ".jsonl");
    const std::filesystem::path log = folder / "run-batch.log";
    std::string command = "'" + options.infer_binary + "' run-batch -m '" + model.string() + "' -i '" +
                          (folder / "workload.jsonl").string() + "' -o '" + output.string() + "' --policy " + policy +
                          " --max-seqs " + std::to_string(max_seqs) + " -t " + std::to_string(options.threads) + " 2> '" +
                          log.string() + "'";
    int status = std::system(command.c_str());
    BatchRun run;
    if (status != 0) throw infer::Error("infer run-batch failed (" + command + "):\n" + infer::read_text_file(log));
    std::ifstream in(output);
    for (std::string line; std::getline(in, line);) {
        infer::Json json = infer::Json::parse(line, output.string());
        const infer::Json& body = json.at("response").at("body");
        run.generated += body.at("usage").at("completion_tokens").as_int();
        run.outputs.push_back(body.at("choices").as_array().at(0).at("text").as_string());
    }
    std::string summary = infer::read_text_file(log);
    if (size_t at = summary.find("steps: "); at != std::string::npos) run.steps = std::atoll(summary.c_str() + at + 7);
    const size_t at = summary.find(" generated in ");
    if (at == std::string::npos) throw infer::Error("infer run-batch printed no \"generated in S s\" in its summary:\n" + summary);
    run.seconds = std::atof(summary.c_str() + at + 14);
    return run;
}

// Decode tokens per second of the whole engine with exactly `running` sequences decoding: short prompts, then only
// the steps in which every sequence decodes (no prefill) are counted.
double decode_rate(const infer::Model& model, infer::ThreadPool& pool, int running) {
    infer::EngineConfig config;
    config.scheduler.max_seqs = running;
    infer::Engine engine(model, pool, config);
    infer::SamplingParams params;
    params.temperature = 0;
    params.max_tokens = 32;
    params.ignore_eos = true;
    std::vector<std::vector<int>> prompts;
    for (int i = 0; i < running; ++i) {
        std::vector<int> prompt{1};
        for (int k = 1; k < 8; ++k) prompt.push_back(3 + (97 * k + 13 * i) % (model.config.vocab_size - 3));
        prompts.push_back(prompt);
    }
    for (const infer::RequestResult& r : engine.generate(prompts, params))
        if (r.finish_reason != infer::FinishReason::Length) throw infer::Error("decode-rate request ended with \"" + std::string(infer::finish_reason_name(r.finish_reason)) + "\": " + r.error);
    double seconds = 0;
    long long tokens = 0;
    for (const infer::StepStats& s : engine.steps())
        if (s.prefill_tokens == 0 && s.decode_tokens == running) {
            seconds += s.schedule + s.forward + s.sample + s.detokenize;
            tokens += s.decode_tokens;
        }
    return static_cast<double>(tokens) / seconds;
}

}  // namespace

int main(int argc, char** argv) try {
    Options options = parse_options(argc, argv);
    const std::filesystem::path folder =
        std::filesystem::temp_directory_path() / ("infer-bench-batch-" + std::to_string(::getpid()));
    std::filesystem::create_directories(folder);
    struct Cleanup {
        std::filesystem::path path;
        ~Cleanup() { std::filesystem::remove_all(path); }
    } cleanup{folder};

    std::filesystem::path model_dir = options.model_dir;
    if (model_dir.empty()) {
        model_dir = folder / "model-110m";
        infer::ModelShape shape;
        shape.dim = 768, shape.n_layers = 12, shape.n_heads = 12, shape.n_kv_heads = 12, shape.ffn_dim = 2048;
        shape.vocab_size = 32000, shape.tied_embeddings = true;
        infer::save_random_model(model_dir, shape, infer::DType::F32, 1);
    }
    infer::Model model = infer::load_model(model_dir);
    write_workload(folder / "workload.jsonl", options, model.config.vocab_size);
    std::printf("run-batch: %d requests (prompts 16-256 tokens, max_tokens 8-256), model %s (%.1fM parameters, %s)\n",
                options.requests, options.model_dir.empty() ? "make-model 110M" : options.model_dir.c_str(),
                static_cast<double>(model.parameter_count()) / 1e6, infer::dtype_name(model.layers[0].wq.dtype));

    struct Policy {
        const char* label;
        std::string policy;
        int max_seqs;
    };
    const Policy policies[] = {{"one at a time", "continuous", 1},
                               {"static", "static", options.max_seqs},
                               {"continuous", "continuous", options.max_seqs}};
    if (options.repeats > 1)
        std::printf("static and continuous: fastest of %d runs each, alternating (one at a time: one run)\n", options.repeats);
    std::printf("%-16s %9s %8s %10s %14s %10s\n", "policy", "max_seqs", "steps", "seconds", "output tok/s", "vs static");
    std::vector<BatchRun> runs(3);
    runs[0] = run_batch(options, folder, model_dir, policies[0].policy, policies[0].max_seqs);
    for (int repeat = 0; repeat < options.repeats; ++repeat)
        for (int k = 0; k < 2; ++k) {
            const size_t i = repeat % 2 == 0 ? 1 + k : 2 - k;  // static first, then continuous first, and so on
            BatchRun run = run_batch(options, folder, model_dir, policies[i].policy, policies[i].max_seqs);
            if (runs[i].outputs.empty() || run.seconds < runs[i].seconds) runs[i] = std::move(run);
        }
    const double static_rate = static_cast<double>(runs[1].generated) / runs[1].seconds;
    for (size_t i = 0; i < runs.size(); ++i) {
        const double rate = static_cast<double>(runs[i].generated) / runs[i].seconds;
        std::printf("%-16s %9d %8lld %10.1f %14.1f %9.2fx\n", policies[i].label, policies[i].max_seqs, runs[i].steps,
                    runs[i].seconds, rate, rate / static_rate);
    }
    const bool same = runs[0].outputs == runs[1].outputs && runs[1].outputs == runs[2].outputs;
    std::printf("outputs identical under every policy: %s\n", same ? "yes" : "NO");

    infer::ThreadPool pool(options.threads);
    std::printf("\naggregate decode rate with N sequences decoding together (steps with no prefill):\n");
    std::printf("%8s %14s %12s\n", "running", "decode tok/s", "vs 1");
    double single = 0;
    for (int running : {1, 4, 16}) {
        double rate = decode_rate(model, pool, running);
        if (running == 1) single = rate;
        std::printf("%8d %14.1f %11.2fx\n", running, rate, rate / single);
    }
    return same ? 0 : 1;
} catch (const std::exception& e) {
    std::cerr << "bench_batch: " << e.what() << '\n';
    return 1;
}
