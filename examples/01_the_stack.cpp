// 01_the_stack — one request's path through the stack, end to end, with the time each layer took.
//
//   01_the_stack [-m PATH] [-p TEXT] [-n N] [-t THREADS]
//
// Loads a model (the built-in demo model without -m), generates greedily from the prompt while streaming the text,
// then prints where the time went: load, tokenize, prefill, decode, sample, detokenize. Chapter 01 walks through it.
#include "command_line.hpp"
#include "infer.hpp"

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <string_view>

namespace {

struct Options {
    std::string model_path;  // empty: the built-in demo model
    std::string prompt = "Once upon a time";
    int max_tokens = 64;
    int threads = 0;  // 0: every core
};

Options parse_options(int argc, char** argv) {
    CommandLine line(argc, argv, 1, {"-m", "-p", "-n", "-t"}, {}, "usage: 01_the_stack [-m PATH] [-p TEXT] [-n N] [-t THREADS]\n");
    Options options;
    options.model_path = line.text("-m");
    options.prompt = line.text("-p", options.prompt);
    options.max_tokens = static_cast<int>(line.integer("-n", options.max_tokens, 0, 1'000'000));
    options.threads = static_cast<int>(line.integer("-t", options.threads, 0, 1024));
    return options;
}

void print_row(const char* layer, double seconds, double total, const std::string& note = "") {
    std::printf("  %-11s %10.2f ms %6.1f %%%s%s\n", layer, seconds * 1e3, total > 0 ? 100.0 * seconds / total : 0.0,
                note.empty() ? "" : "   ", note.c_str());
}

std::string rate(double count, double seconds, const char* unit) {
    if (count <= 0 || seconds <= 0) return "";
    char text[64];
    std::snprintf(text, sizeof text, "%.0f %s, %.0f %s/s", count, unit, count / seconds, unit);
    return text;
}

}  // namespace

int main(int argc, char** argv) try {
    Options options = parse_options(argc, argv);

    // Loading maps the file and parses its header; the weights are paged in later, by the first forward pass that
    // touches them. So this figure is small even for a large checkpoint, and prefill pays the page faults instead.
    infer::Stopwatch load_clock;
    infer::Model model = options.model_path.empty() ? infer::demo_model() : infer::load_model(options.model_path);
    double load_seconds = load_clock.seconds();
    if (options.model_path.empty())
        std::cerr << "note: no -m given, so this runs the built-in demo model: random weights, meaningless text, "
                     "but the cost per token of a real model of its shape\n";

    infer::ThreadPool pool(options.threads);
    infer::SamplingParams params;
    params.temperature = 0;  // greedy: the same prompt gives the same text, so runs can be compared
    params.max_tokens = options.max_tokens;

    // The prompt is echoed with the first piece of output, so a prompt the tokenizer rejects leaves no stray text.
    bool echoed = false;
    auto stream = [&](std::string_view text) {
        if (!echoed) std::cout << options.prompt;
        echoed = true;
        std::cout << text << std::flush;  // flushed per piece: the reader sees each token as it is decoded
    };
    infer::Stopwatch generate_clock;
    infer::GenerationResult result = infer::generate(model, pool, options.prompt, params, stream);
    double generate_seconds = generate_clock.seconds();
    if (!echoed) std::cout << options.prompt;
    std::cout << "\n\n";

    infer::LayerTimes times = result.times;
    times.load = load_seconds;
    // What generate spent outside the timed layers: the KV cache allocation and printing the streamed text.
    double other = generate_seconds - (times.tokenize + times.prefill + times.decode + times.sample + times.detokenize);
    double total = load_seconds + generate_seconds;

    // Each loop step runs one forward call. The first is prefill; every later one is a decode step. The last step's
    // token is never fed back, and a stop token ends the loop without being kept, hence the adjustment.
    const int prompt_tokens = static_cast<int>(result.prompt_ids.size());
    const int generated = static_cast<int>(result.generated_ids.size());
    const int forward_calls = result.finish_reason == infer::FinishReason::Stop ? generated + 1 : generated;
    const int decode_steps = std::max(0, forward_calls - 1);

    const infer::ModelConfig& c = model.config;
    std::printf("model: %s (%s, %s, %.2f M parameters), %d thread%s\n", model.source.c_str(), infer::format_name(model.format),
                c.architecture.c_str(), static_cast<double>(model.parameter_count()) / 1e6, pool.size(),
                pool.size() == 1 ? "" : "s");
    std::printf("prompt %d tokens, generated %d tokens, finish: %s\n\n", prompt_tokens, generated,
                infer::finish_reason_name(result.finish_reason));
    std::printf("  %-11s %13s %8s\n", "layer", "time", "share");
    print_row("load", times.load, total);
    print_row("tokenize", times.tokenize, total);
    print_row("prefill", times.prefill, total, forward_calls > 0 ? rate(prompt_tokens, times.prefill, "tokens") : "");
    print_row("decode", times.decode, total, rate(decode_steps, times.decode, "tokens"));
    print_row("sample", times.sample, total);
    print_row("detokenize", times.detokenize, total);
    print_row("other", other, total, "KV cache allocation, printing");
    print_row("total", total, total);
    return 0;
} catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
}
