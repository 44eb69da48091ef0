// 06_speculative_decoding — guess the next tokens cheaply, verify them in one pass: what it costs and what it buys.
//
//   06_speculative_decoding [-m PATH] [--draft-model PATH] [--draft-layers N] [-k 1,2,4,8] [-n TOKENS] [-t THREADS]
//
// Three experiments through the real Engine (infer.hpp section 06, "Speculative decoding"):
//   1. the price of checking k guesses: one forward pass of 1 + k tokens of one sequence against a 1-token pass, at
//      the same context. Decode is memory-bound, so the ratio stays near 1 while the weights dominate the bytes;
//   2. n-gram prompt lookup on two workloads, greedy, batch 1: a copy-heavy one (a passage, then the passage again,
//      which the model continues by copying) and a plain story; tokens per step, share of guesses kept, tok/s and
//      speed-up over decoding without speculation, for each k;
//   3. a draft model: --draft-model PATH (same vocabulary), or without it the target's own first --draft-layers
//      layers with its head (a self-speculative draft: no second checkpoint); the same table, and the break-even
//      acceptance computed from the measured step costs.
// Every speculative run must give the ids of the plain run, token for token; the program fails if one does not.
// Without -m it uses the built-in demo model. Chapter 06 walks through it, in its last section.
#include "command_line.hpp"
#include "infer.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>

namespace {

struct Options {
    std::string model_path, draft_path;
    int draft_layers = 0;  // 0: a quarter of the target's layers, at least 1
    std::vector<int> ks = {1, 2, 4, 8};
    int tokens = 96;
    int threads = 0;
};

Options parse_options(int argc, char** argv) {
    const char* usage = "usage: 06_speculative_decoding [-m PATH] [--draft-model PATH] [--draft-layers N] [-k 1,2,4,8] "
                        "[-n TOKENS] [-t THREADS]\n";
    CommandLine line(argc, argv, 1, {"-m", "--draft-model", "--draft-layers", "-k", "-n", "-t"}, {}, usage);
    Options options;
    options.model_path = line.text("-m");
    options.draft_path = line.text("--draft-model");
    options.draft_layers = static_cast<int>(line.integer("--draft-layers", 0, 1, 1024));
    options.tokens = static_cast<int>(line.integer("-n", options.tokens, 1, 1 << 16));
    options.threads = static_cast<int>(line.integer("-t", 0, 0, 1024));
    if (line.has("-k")) options.ks = parse_int_list("-k", line.text("-k"));
    for (int k : options.ks)
        if (k > 64) infer::fail("option -k: ", k, " guesses per step is more than 64");
    return options;
}

// ---- 1. The price of a verifying step -------------------------------------------------------------------------------
// Seconds for one forward pass of `rows` consecutive tokens of one sequence whose first `context` positions are
// already in the cache, every row asking for logits (verification reads all k + 1 of them). Best of `repeats`.
double step_seconds(const infer::Model& model, infer::ThreadPool& pool, int context, int rows, int repeats) {
    infer::ForwardPass forward(model, pool);
    const int block_size = 16;
    infer::KVCache cache(model.config, (context + rows) / block_size + 2, block_size);
    if (!cache.reserve(0, context + rows)) throw infer::Error("06_speculative_decoding: the KV pool is too small");
    infer::Batch batch;
    for (int p = 0; p < context; ++p) batch.add(3 + p % (model.config.vocab_size - 3), p, 0, p == context - 1);
    forward.forward(batch, cache);
    double best = 1e30;
    for (int r = 0; r < repeats; ++r) {
        batch.clear();
        for (int i = 0; i < rows; ++i) batch.add(3 + i, context + i, 0, true);
        infer::Stopwatch clock;
        forward.forward(batch, cache);  // the same positions each time: a rejected guess is overwritten the same way
        best = std::min(best, clock.seconds());
    }
    return best;
}

// ---- 2 and 3. Decoding with and without a proposer ------------------------------------------------------------------

struct Run {
    std::vector<int> ids;
    double seconds = 0;
    int steps = 0, drafted = 0, accepted = 0;
};

Run decode(const infer::Model& model, infer::ThreadPool& pool, const std::vector<int>& prompt, int tokens,
           const infer::SpecConfig& spec) {
    infer::EngineConfig config;
    config.scheduler.max_seqs = 1;
    config.num_blocks = (static_cast<int>(prompt.size()) + tokens + 16) / 16 + 2;
    config.spec = spec;
    infer::Engine engine(model, pool, config);
    infer::SamplingParams params;
    params.temperature = 0;
    params.max_tokens = tokens;
    params.ignore_eos = true;  // every run produces the same number of tokens
    const int id = engine.add_request(prompt, params);
    engine.step();  // the prefill: the same for every run, left out of the decode time
    Run run;
    infer::Stopwatch clock;
    while (engine.has_work()) {
        engine.step();
        ++run.steps;
    }
    run.seconds = clock.seconds();
    const infer::RequestResult result = *engine.take_result(id);
    run.ids = result.generated_ids;
    run.drafted = result.draft_tokens;
    run.accepted = result.accepted_tokens;
    return run;
}

void print_runs(const char* title, const infer::Model& model, infer::ThreadPool& pool, const std::vector<int>& prompt,
                const Options& options, infer::SpecConfig spec) {
    const Run plain = decode(model, pool, prompt, options.tokens, {});
    const double decoded = static_cast<double>(plain.ids.size() - 1);  // the first id came with the prefill
    std::printf("   %s (prompt %zu tokens, %zu generated)\n", title, prompt.size(), plain.ids.size());
    std::printf("   %-9s %7s %11s %9s %12s %9s\n", "k", "steps", "tokens/step", "kept", "decode tok/s", "speed-up");
    std::printf("   %-9s %7d %11.2f %9s %12.1f %8.2fx\n", "none", plain.steps, decoded / plain.steps, "-",
                decoded / plain.seconds, 1.0);
    for (int k : options.ks) {
        spec.k = k;
        const Run run = decode(model, pool, prompt, options.tokens, spec);
        if (run.ids != plain.ids)
            throw infer::Error(std::string("speculative decoding changed the greedy output (k ") + std::to_string(k) +
                               "): that is a bug");
        std::printf("   %-9d %7d %11.2f %8.1f%% %12.1f %8.2fx\n", k, run.steps, decoded / run.steps,
                    run.drafted > 0 ? 100.0 * run.accepted / run.drafted : 0.0, decoded / run.seconds,
                    plain.seconds / run.seconds);
    }
    std::printf("   every k gave the ids of the plain run, token for token\n");
}

// The target's first `layers` layers, its final norm and its head: a draft that needs no second checkpoint. Loaded
// again from the same file (the pages are shared through the OS cache), then cut.
infer::Model first_layers_of(const Options& options, int layers) {
    infer::Model draft = options.model_path.empty() ? infer::demo_model() : infer::load_model(options.model_path);
    draft.layers.resize(static_cast<size_t>(layers));
    draft.config.n_layers = layers;
    return draft;
}

}  // namespace

int main(int argc, char** argv) {
    try {
        const Options options = parse_options(argc, argv);
        const infer::Model model = model_or_demo(options.model_path);
        infer::ThreadPool pool(options.threads);
        const int L = model.config.n_layers;
        std::printf("model: %s, %d layers, %.1f M parameters, %d threads\n\n", model.source.c_str(), L,
                    static_cast<double>(model.parameter_count()) / 1e6, pool.size());

        // 1. What a verifying step costs.
        const int context = std::min(64, model.config.context_length / 2);
        const int k_max = *std::max_element(options.ks.begin(), options.ks.end());
        std::printf("1. One forward pass of 1 + k tokens at context %d, against a 1-token pass (best of 5):\n", context);
        std::printf("   %-9s %10s %12s\n", "rows", "ms", "× 1 row");
        const double one = step_seconds(model, pool, context, 1, 5);
        std::vector<double> cost_ratio(static_cast<size_t>(k_max + 2), 1.0);  // [rows] c(rows) / c(1)
        for (int k : options.ks) {
            const double seconds = step_seconds(model, pool, context, k + 1, 5);
            cost_ratio[static_cast<size_t>(k + 1)] = seconds / one;
            std::printf("   %-9d %10.3f %11.2fx\n", k + 1, 1e3 * seconds, seconds / one);
        }
        std::printf("   (1 row: %.3f ms)\n", 1e3 * one);

        // 2. Prompt lookup. The story prompt is an opening ("Once upon a time" where the model has a tokenizer); the
        // copy-heavy prompt is that opening, a passage the model wrote after it, and the opening again: a model that
        // continues by copying writes the passage a second time, and the lookup finds every next id in the prompt.
        const std::vector<int> opening = infer::has_tokenizer(model)
                                             ? infer::tokenizer_for(model).encode("Once upon a time")
                                             : std::vector<int>{model.config.bos_id >= 0 ? model.config.bos_id : 1, 3};
        const Run passage = decode(model, pool, opening, std::min(64, model.config.context_length / 4), {});
        std::vector<int> copy_prompt = opening;
        copy_prompt.insert(copy_prompt.end(), passage.ids.begin(), passage.ids.end());
        copy_prompt.insert(copy_prompt.end(), opening.begin() + (opening.front() == model.config.bos_id), opening.end());
        infer::SpecConfig ngram;
        ngram.method = infer::SpecMethod::Ngram;
        std::printf("\n2. n-gram prompt lookup (n %d), greedy, batch 1:\n", ngram.ngram);
        print_runs("copy-heavy: a passage, then its opening again", model, pool, copy_prompt, options, ngram);
        std::printf("\n");
        print_runs("story: only the opening", model, pool, opening, options, ngram);

        // 3. A draft model.
        const int draft_layers = options.draft_layers > 0 ? std::min(options.draft_layers, L) : std::max(1, L / 4);
        auto draft = std::make_shared<infer::Model>(options.draft_path.empty() ? first_layers_of(options, draft_layers)
                                                                                 : infer::load_model(options.draft_path));
        infer::SpecConfig drafting;
        drafting.method = infer::SpecMethod::Draft;
        drafting.draft_model = draft;
        const double draft_step = step_seconds(*draft, pool, context, 1, 5);
        std::printf("\n3. Draft model: %s (%d layers, %.1f M parameters); one draft step %.3f ms = %.2f of a target step\n",
                    options.draft_path.empty() ? "the target's first layers" : draft->source.c_str(), draft->config.n_layers,
                    static_cast<double>(draft->parameter_count()) / 1e6, 1e3 * draft_step, draft_step / one);
        print_runs("story: only the opening", model, pool, opening, options, drafting);
        // A step that verifies k guesses costs c(k+1) and k draft passes (the first also catches the draft up on the
        // target's last token) and yields (1 - a^(k+1)) / (1 - a) tokens at acceptance a; it pays when that beats one
        // token per c(1).
        std::printf("   break-even acceptance (speculation as fast as plain decoding), from the step costs of part 1:\n");
        for (int k : options.ks) {
            const double cost = cost_ratio[static_cast<size_t>(k + 1)] + k * draft_step / one;
            double low = 0, high = 1;
            for (int i = 0; i < 60; ++i) {
                const double a = (low + high) / 2;
                const double yield = a >= 1 ? k + 1 : (1 - std::pow(a, k + 1)) / (1 - a);
                (yield < cost ? low : high) = a;
            }
            std::printf("   k %-3d cost %.2f target steps per verifying step: pays above %.0f%% kept%s\n", k, cost, 100 * high,
                        high >= 0.999 ? " (never: the step costs more than k + 1 tokens)" : "");
        }
        return 0;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "error: %s\n", e.what());
        return 1;
    }
}
