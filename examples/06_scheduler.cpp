// 06_scheduler — what the scheduler decides, and what each decision costs.
//
//   06_scheduler [-m PATH] [--requests N] [--max-seqs N] [--trace FILE] [--seed S] [-t THREADS]
//
// Three experiments through the real Scheduler and Engine (infer.hpp section 06):
//   1. one workload (mixed prompt and output lengths) run one request at a time, with the static policy (admit a
//      batch, run it to its end) and with continuous batching: steps, sequences per step, throughput, latency;
//      --trace FILE writes the continuous run as a Chrome trace (open it in ui.perfetto.dev);
//   2. chunked prefill: a long prompt arrives while others decode; their longest wait between two tokens with the
//      whole prompt in one step, and with it cut into chunks;
//   3. preemption: a KV pool too small for every request at once; which steps preempted, and the outputs compared
//      with a run that had room.
// Without -m it uses the built-in demo model. Chapter 06 walks through it.
#include "command_line.hpp"
#include "infer.hpp"

#include <cstdio>
#include <fstream>
#include <iostream>
#include <random>

namespace {

struct Options {
    std::string model_path, trace_path;
    int requests = 32;
    int max_seqs = 8;
    uint64_t seed = 11;
    int threads = 0;
};

Options parse_options(int argc, char** argv) {
    CommandLine line(argc, argv, 1, {"-m", "--requests", "--max-seqs", "--trace", "--seed", "-t"}, {},
                     "usage: 06_scheduler [-m PATH] [--requests N] [--max-seqs N] [--trace FILE] [--seed S] [-t THREADS]\n");
    Options options;
    options.model_path = line.text("-m");
    options.trace_path = line.text("--trace");
    options.requests = static_cast<int>(line.integer("--requests", options.requests, 1, 4096));
    options.max_seqs = static_cast<int>(line.integer("--max-seqs", options.max_seqs, 1, 4096));
    options.seed = static_cast<uint64_t>(line.integer("--seed", 11, 0, std::numeric_limits<long long>::max()));
    options.threads = static_cast<int>(line.integer("-t", options.threads, 0, 1024));
    return options;
}

std::vector<int> random_prompt(const infer::Model& model, int length, std::mt19937_64& rng) {
    std::vector<int> prompt{model.config.bos_id >= 0 ? model.config.bos_id : 1};
    while (static_cast<int>(prompt.size()) < length) prompt.push_back(3 + static_cast<int>(rng() % (model.config.vocab_size - 3)));
    return prompt;
}

infer::SamplingParams exactly(int tokens) {
    infer::SamplingParams params;
    params.temperature = 0;
    params.max_tokens = tokens;
    params.ignore_eos = true;  // every request runs to its limit, so the workload is the same under every policy
    return params;
}

double mean(const std::vector<double>& values) {
    double sum = 0;
    for (double v : values) sum += v;
    return values.empty() ? 0 : sum / static_cast<double>(values.size());
}

// ---- 1. One at a time, static, continuous -------------------------------------------------------------------------

struct Run {
    std::vector<infer::RequestResult> results;
    std::vector<infer::StepStats> steps;
    double seconds = 0;
};

Run run_workload(const infer::Model& model, infer::ThreadPool& pool, infer::SchedulerConfig scheduler,
                 const std::vector<std::vector<int>>& prompts, const std::vector<int>& max_tokens) {
    infer::EngineConfig config;
    config.scheduler = scheduler;
    infer::Engine engine(model, pool, config);
    Run run;
    std::vector<int> ids;
    for (size_t i = 0; i < prompts.size(); ++i) ids.push_back(engine.add_request(prompts[i], exactly(max_tokens[i])));
    infer::Stopwatch clock;
    while (engine.has_work()) engine.step();
    run.seconds = clock.seconds();
    for (int id : ids) run.results.push_back(*engine.take_result(id));
    run.steps = engine.steps();
    return run;
}

void compare_policies(const infer::Model& model, infer::ThreadPool& pool, const Options& options) {
    std::mt19937_64 rng(options.seed);
    std::vector<std::vector<int>> prompts;
    std::vector<int> max_tokens;
    for (int i = 0; i < options.requests; ++i) {
        prompts.push_back(random_prompt(model, 16 + static_cast<int>(rng() % 113), rng));
        max_tokens.push_back(8 + static_cast<int>(rng() % 121));
    }
    std::printf("1. %d requests (prompts 16-128 tokens, outputs 8-128 tokens), at most %d running:\n", options.requests,
                options.max_seqs);
    std::printf("   %-16s %7s %11s %12s %11s %11s %11s\n", "policy", "steps", "seqs/step", "output tok/s", "speed-up",
                "mean TTFT s", "mean e2e s");
    struct Policy {
        const char* name;
        infer::SchedulePolicy policy;
        int max_seqs;
    };
    const Policy policies[] = {{"one at a time", infer::SchedulePolicy::Continuous, 1},
                               {"static", infer::SchedulePolicy::Static, options.max_seqs},
                               {"continuous", infer::SchedulePolicy::Continuous, options.max_seqs}};
    double baseline = 0;
    std::vector<std::vector<int>> reference;
    for (const Policy& p : policies) {
        infer::SchedulerConfig scheduler;
        scheduler.policy = p.policy;
        scheduler.max_seqs = p.max_seqs;
        Run run = run_workload(model, pool, scheduler, prompts, max_tokens);
        double generated = 0, sequences = 0;
        std::vector<double> ttft, e2e;
        std::vector<std::vector<int>> outputs;
        for (const infer::RequestResult& r : run.results) {
            generated += static_cast<double>(r.generated_ids.size());
            ttft.push_back(r.times.first_token - r.times.arrival);
            e2e.push_back(r.times.finished - r.times.arrival);
            outputs.push_back(r.generated_ids);
        }
        for (const infer::StepStats& s : run.steps) sequences += s.sequences;
        const double throughput = generated / run.seconds;
        if (baseline == 0) baseline = throughput, reference = outputs;
        std::printf("   %-16s %7zu %11.2f %12.1f %10.2fx %11.3f %11.3f\n", p.name, run.steps.size(),
                    sequences / static_cast<double>(std::max<size_t>(run.steps.size(), 1)), throughput, throughput / baseline,
                    mean(ttft), mean(e2e));
        if (outputs != reference) throw infer::Error(std::string("the ") + p.name + " policy changed an output: that is a bug");
        if (p.name == std::string("continuous") && !options.trace_path.empty()) {
            std::ofstream trace(options.trace_path);
            if (!trace) throw infer::Error(options.trace_path + ": cannot create");
            infer::write_chrome_trace(trace, run.steps, run.results);
            infer::close_written_file(trace, options.trace_path);
            std::printf("   trace of the continuous run: %s (open in ui.perfetto.dev)\n", options.trace_path.c_str());
        }
    }
    std::printf("   every policy produced the same ids for every request\n");
}

// ---- 2. Chunked prefill ------------------------------------------------------------------------------------------------

void chunked_prefill(const infer::Model& model, infer::ThreadPool& pool, const Options& options) {
    std::mt19937_64 rng(options.seed + 1);
    const int long_prompt = std::min(1024, model.config.context_length - 64);
    std::vector<std::vector<int>> decoders;
    for (int i = 0; i < 4; ++i) decoders.push_back(random_prompt(model, 16, rng));
    const std::vector<int> newcomer = random_prompt(model, long_prompt, rng);
    std::printf("\n2. Chunked prefill: 4 requests decoding when a %d-token prompt arrives\n", long_prompt);
    std::printf("   %-22s %24s %26s\n", "max_batch_tokens", "longest decode gap (ms)", "newcomer's TTFT (ms)");
    for (int budget : {long_prompt + 64, 256, 64}) {
        infer::EngineConfig config;
        config.scheduler.max_batch_tokens = budget;
        infer::Engine engine(model, pool, config);
        std::vector<int> ids;
        for (const auto& prompt : decoders) ids.push_back(engine.add_request(prompt, exactly(48)));
        for (int i = 0; i < 8; ++i) engine.step();  // they are decoding now
        const double arrival = engine.now();
        int late = engine.add_request(newcomer, exactly(4));
        while (engine.has_work()) engine.step();
        double gap = 0;
        for (int id : ids) {
            const std::vector<double> times = engine.take_result(id)->times.token_times;
            for (size_t i = 1; i < times.size(); ++i)
                if (times[i] > arrival) gap = std::max(gap, times[i] - times[i - 1]);
        }
        const infer::RequestResult newcomer_result = *engine.take_result(late);
        std::printf("   %-22d %24.2f %26.2f\n", budget, 1e3 * gap, 1e3 * (newcomer_result.times.first_token - arrival));
    }
}

// ---- 3. Preemption -----------------------------------------------------------------------------------------------------

void preemption(const infer::Model& model, infer::ThreadPool& pool, const Options& options) {
    std::mt19937_64 rng(options.seed + 2);
    std::vector<std::vector<int>> prompts;
    for (int i = 0; i < 6; ++i) prompts.push_back(random_prompt(model, 40, rng));
    const infer::SamplingParams params = exactly(60);
    infer::EngineConfig roomy;
    infer::Engine reference_engine(model, pool, roomy);
    const auto reference = reference_engine.generate(prompts, params);

    infer::EngineConfig tight;
    tight.block_size = 16;
    tight.num_blocks = 16;  // 256 tokens of KV; six requests grow to 100 tokens each
    tight.prefix_caching = false;
    infer::Engine engine(model, pool, tight);
    const auto results = engine.generate(prompts, params);
    std::printf("\n3. Preemption: 6 requests of 40 + 60 tokens in a pool of %d blocks × %d tokens (%d tokens)\n",
                tight.num_blocks, tight.block_size, tight.num_blocks * tight.block_size);
    int shown = 0;
    for (size_t i = 0; i < engine.steps().size(); ++i) {
        const infer::StepStats& s = engine.steps()[i];
        if (s.preemptions == 0) continue;
        if (shown++ < 5)
            std::printf("   step %3zu: %d preempted; %d sequences ran, %d prefill + %d decode tokens, %d blocks used, %d free\n", i,
                        s.preemptions, s.sequences, s.prefill_tokens, s.decode_tokens, s.blocks_used, s.blocks_free);
    }
    int preempted = 0;
    bool same = true;
    for (size_t i = 0; i < results.size(); ++i) {
        preempted += results[i].preemptions > 0;
        same = same && results[i].generated_ids == reference[i].generated_ids;
    }
    std::printf("   %lld preemptions in %zu steps; %d of 6 requests were preempted at least once and recomputed\n",
                static_cast<long long>(engine.totals().preemptions), engine.steps().size(), preempted);
    std::printf("   outputs identical to a run with room for all: %s\n", same ? "yes" : "NO");
    if (!same) throw infer::Error("preemption changed an output: that is a bug");
}

}  // namespace

int main(int argc, char** argv) try {
    Options options = parse_options(argc, argv);
    infer::Model model = model_or_demo(options.model_path);
    infer::ThreadPool pool(options.threads);
    compare_policies(model, pool, options);
    chunked_prefill(model, pool, options);
    preemption(model, pool, options);
    return 0;
} catch (const std::exception& e) {
    std::cerr << "06_scheduler: " << e.what() << '\n';
    return 1;
}
