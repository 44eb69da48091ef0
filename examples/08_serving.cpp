// Chapter 08 — the serving framework. Starts `infer serve` as a user would and talks to it over HTTP:
//   1. one request through every layer: the server's own breakdown (infer_timing) of where its time went;
//   2. twice the capacity at once: a burst of 2 x --max-seqs streamed requests, first against a server that queues
//      (--max-queue 64), then against one that does not (--max-queue 0): queueing trades time to first token for
//      completeness, rejecting (429) keeps the admitted requests fast and tells the others at once.
//
//   08_serving --infer build/infer [-m MODEL] [--max-seqs 4] [--tokens 64]
#include "infer.hpp"
#include "command_line.hpp"
#include "serving_client.hpp"

#include <cstdio>

namespace {

const char* usage = "usage: 08_serving --infer PATH_TO_INFER [-m MODEL] [--max-seqs S] [--tokens N] [-t THREADS]\n"
                    "  without -m: the built-in demo model\n";

std::vector<std::string> server_args(const CommandLine& options, int max_queue) {
    std::vector<std::string> args = {"--max-seqs", options.text("--max-seqs", "4"), "--max-queue", std::to_string(max_queue),
                                     "-t", options.text("-t", "0")};
    if (options.has("-m")) args.insert(args.end(), {"-m", options.text("-m")});
    return args;
}

void burst(const CommandLine& options, int max_queue, const nlohmann::json& body) {
    client::ServeProcess server(options.text("--infer"), server_args(options, max_queue));
    const int count = 2 * static_cast<int>(options.integer("--max-seqs", 4, 1, 256));
    std::vector<client::Timed> results(static_cast<size_t>(count));
    infer::Stopwatch wall;
    client::run_concurrently(count, count, [&](int i) { results[static_cast<size_t>(i)] = client::stream_completion(server.port(), body); });
    const double seconds = wall.seconds();
    std::vector<double> ttft, e2e, refused;
    for (const client::Timed& r : results) {
        if (r.status == 200) {
            ttft.push_back(r.ttft * 1e3);
            e2e.push_back(r.e2e * 1e3);
        } else {
            refused.push_back(r.e2e * 1e3);
        }
    }
    std::printf("  --max-queue %-3d  %2zu accepted, %2zu got 429 (answered in %.1f ms at most) | accepted: TTFT p50 %.1f ms, "
                "max %.1f ms; end to end p50 %.1f ms, max %.1f ms | burst done in %.1f ms\n",
                max_queue, ttft.size(), refused.size(), refused.empty() ? 0.0 : client::percentile(refused, 100),
                client::percentile(ttft, 50), client::percentile(ttft, 100), client::percentile(e2e, 50),
                client::percentile(e2e, 100), seconds * 1e3);
}

}  // namespace

int main(int argc, char** argv) {
    try {
        CommandLine options(argc, argv, 1, {"--infer", "-m", "--max-seqs", "--tokens", "-t"}, {}, usage);
        if (!options.has("--infer")) infer::fail("08_serving needs --infer PATH (the infer program to start)");
        const int tokens = static_cast<int>(options.integer("--tokens", 64, 1, 100000));
        const nlohmann::json body = {{"prompt", "Once upon a time, there was a little girl who"}, {"max_tokens", tokens},
                                     {"temperature", 0}, {"ignore_eos", true}};

        std::printf("1. One request through every layer (%d tokens, streamed), as the server timed it:\n", tokens);
        {
            client::ServeProcess server(options.text("--infer"), server_args(options, 64));
            client::stream_completion(server.port(), body);  // warm-up: first touches of the weights and the pool
            client::Timed one = client::stream_completion(server.port(), body);
            const double e2e = one.timing["e2e_ms"].get<double>();
            double parts = 0;
            for (const char* name : {"http_parse_ms", "tokenize_ms", "route_ms", "step_wait_ms", "queue_ms", "schedule_ms", "prefill_ms",
                                     "decode_ms", "sample_ms", "detokenize_ms", "http_write_ms", "other_ms"}) {
                const double ms = one.timing.value(name, 0.0);
                parts += ms;
                std::printf("  %-16s %9.3f ms  %5.1f%%\n", name, ms, 100 * ms / e2e);
            }
            std::printf("  %-16s %9.3f ms  (the parts sum to %.3f ms)\n", "e2e_ms", e2e, parts);
            std::printf("  client side: TTFT %.2f ms, end to end %.2f ms, %d tokens\n\n", one.ttft * 1e3, one.e2e * 1e3, one.tokens);
        }

        std::printf("2. Twice the capacity at once: %lld streamed requests against --max-seqs %lld\n",
                    2 * options.integer("--max-seqs", 4, 1, 256), options.integer("--max-seqs", 4, 1, 256));
        burst(options, 64, body);
        burst(options, 0, body);
        return 0;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "error: %s\n", e.what());
        return 1;
    }
}
