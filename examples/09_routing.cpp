// Chapter 09 — routing. Starts `infer serve --instances N` once per policy and sends each the same shared-prefix
// workload: G "system prompts", each followed by R different questions, interleaved, C at a time. For each policy it
// reports the prefix-cache hit rate (from /metrics), the time to first token and how the requests spread. The
// prefix policy keeps each system prompt on one instance, so its prefill is paid once per group, not once per
// instance a request happens to land on.
//
//   09_routing --infer build/infer [-m MODEL] [--instances 2] [--groups 4] [--per-group 8] [--concurrency 4]
//              [--kv-blocks B]   (a pool too small for every prefix on every instance: where routing matters most)
#include "infer.hpp"
#include "command_line.hpp"
#include "serving_client.hpp"

#include <cstdio>
#include <random>

namespace {

const char* usage = "usage: 09_routing --infer PATH_TO_INFER [-m MODEL] [--instances N] [--groups G] [--per-group R]\n"
                    "                  [--concurrency C] [--prefix-chars P] [--kv-blocks B] [-t THREADS]\n"
                    "  --kv-blocks: each instance's KV pool; small enough that one instance cannot hold every prefix\n";

// A system prompt of about `chars` characters, different for each group from its first word on.
std::string system_prompt(int group, int chars) {
    static const char* topics[] = {"dragons", "the sea", "a small robot", "a lost key", "the moon", "a garden", "a train", "snow"};
    std::string text = "Story " + std::to_string(group) + " is about " + topics[group % 8] + ".";
    while (static_cast<int>(text.size()) < chars)
        text += " The children listened as the story about " + std::string(topics[group % 8]) + " went on.";
    return text.substr(0, static_cast<size_t>(chars));
}

}  // namespace

int main(int argc, char** argv) {
    try {
        CommandLine options(argc, argv, 1, {"--infer", "-m", "--instances", "--groups", "--per-group", "--concurrency",
                                            "--prefix-chars", "--kv-blocks", "-t"}, {}, usage);
        if (!options.has("--infer")) infer::fail("09_routing needs --infer PATH (the infer program to start)");
        const int instances = static_cast<int>(options.integer("--instances", 2, 1, 64));
        const int groups = static_cast<int>(options.integer("--groups", 4, 1, 64));
        const int per_group = static_cast<int>(options.integer("--per-group", 8, 1, 1000));
        const int concurrency = static_cast<int>(options.integer("--concurrency", 4, 1, 256));
        const int prefix_chars = static_cast<int>(options.integer("--prefix-chars", options.has("-m") ? 600 : 400, 16, 100000));
        // The groups' requests in a shuffled order (fixed seed), as users of different system prompts arrive: a plain
        // interleaving would let round-robin keep each group on one instance by accident.
        std::vector<std::string> prompts;
        for (int i = 0; i < groups * per_group; ++i)
            prompts.push_back(system_prompt(i % groups, prefix_chars) + " Question " + std::to_string(i / groups) + ": what happened next?");
        std::shuffle(prompts.begin(), prompts.end(), std::mt19937(7));

        std::printf("%d instances, %d groups x %d requests sharing a %d-character prefix, %d at a time\n\n", instances,
                    groups, per_group, prefix_chars, concurrency);
        std::printf("  %-13s %9s %11s %11s %11s %12s  %s\n", "policy", "hit rate", "TTFT mean", "TTFT p50", "TTFT p90",
                    "wall", "requests per instance");
        for (std::string policy : {"round-robin", "least-loaded", "prefix"}) {
            std::vector<std::string> args = {"--instances", std::to_string(instances), "--route", policy,
                                             "-t", options.text("-t", "0")};
            if (options.has("-m")) args.insert(args.end(), {"-m", options.text("-m")});
            if (options.has("--kv-blocks")) args.insert(args.end(), {"--kv-blocks", options.text("--kv-blocks")});
            client::ServeProcess server(options.text("--infer"), args);
            std::vector<double> ttft(prompts.size());
            infer::Stopwatch wall;
            client::run_concurrently(static_cast<int>(prompts.size()), concurrency, [&](int i) {
                client::Timed t = client::stream_completion(
                    server.port(), {{"prompt", prompts[static_cast<size_t>(i)]}, {"max_tokens", 8}, {"temperature", 0}, {"ignore_eos", true}});
                if (t.status != 200) infer::fail("request ", i, " got HTTP ", t.status);
                ttft[static_cast<size_t>(i)] = t.ttft * 1e3;
            });
            const double seconds = wall.seconds();
            auto samples = client::scrape(server.port());
            const double hits = client::total(samples, "infer:prefix_cache_hits_total");
            const double queries = client::total(samples, "infer:prefix_cache_queries_total");
            std::string spread;
            for (int i = 0; i < instances; ++i)
                spread += (i ? " / " : "") + std::to_string(static_cast<int>(
                              client::total(samples, "infer:instance_requests_total{instance=\"" + std::to_string(i) + "\"}")));
            double mean = 0;
            for (double t : ttft) mean += t / static_cast<double>(ttft.size());
            std::printf("  %-13s %8.1f%% %8.2f ms %8.2f ms %8.2f ms %9.0f ms  %s\n", policy.c_str(),
                        queries > 0 ? 100 * hits / queries : 0.0, mean, client::percentile(ttft, 50),
                        client::percentile(ttft, 90), seconds * 1e3, spread.c_str());
        }
        return 0;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "error: %s\n", e.what());
        return 1;
    }
}
