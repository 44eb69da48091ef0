// 10_benchmarking — the serving metrics, computed by hand on five requests and then measured on the engine.
//
//   10_benchmarking [-m PATH] [-t THREADS] [--input-len I] [--output-len O]
//
// First the arithmetic `infer bench serve` does, on timestamps small enough to check in your head: TTFT, TPOT
// ((e2e − TTFT)/(tokens − 1) per request), ITL (every gap), percentiles by numpy's linear interpolation, goodput under
// an SLO. Then the engine in process (bench::run_engine, what `infer bench engine` runs) at batch 1, 4 and 16. On a
// model larger than the caches, output throughput grows with the batch while each request's TPOT grows far less, as
// a decode step reads the weights once for the whole batch; on stories260K (1 MB, cache-resident) it does not: its
// steps cost what their arithmetic costs, so the batch only stretches TPOT. Without -m, the built-in demo model.
// Chapter 10 walks through it.
#include "bench.hpp"
#include "command_line.hpp"
#include "infer.hpp"

#include <cstdio>
#include <iostream>

int main(int argc, char** argv) try {
    CommandLine line(argc, argv, 1, {"-m", "-t", "--input-len", "--output-len"}, {},
                     "usage: 10_benchmarking [-m PATH] [-t THREADS] [--input-len I] [--output-len O]\n");

    // ---- The metric arithmetic on five made-up requests (seconds from each request's send).
    struct Made { double ttft, last; int tokens; };
    const Made made[] = {{0.05, 0.45, 9}, {0.10, 0.50, 5}, {0.20, 1.00, 9}, {0.05, 0.05, 1}, {0.80, 1.60, 5}};
    std::vector<bench::RequestRecord> records;
    for (const Made& m : made) {
        bench::RequestRecord r;
        r.success = true;
        r.ttft = m.ttft;
        r.latency = r.done = m.last;
        r.output_tokens = m.tokens;
        r.prompt_tokens = 32;
        for (int i = 1; i < m.tokens; ++i) r.itl.push_back((m.last - m.ttft) / (m.tokens - 1));  // evenly spaced
        records.push_back(r);
    }
    std::printf("five requests over 2 s:\n| # | TTFT ms | E2E ms | tokens | TPOT ms |\n|---|--------:|-------:|-------:|--------:|\n");
    for (size_t i = 0; i < records.size(); ++i)
        std::printf("| %zu | %7.0f | %6.0f | %6d | %7.1f |\n", i + 1, records[i].ttft * 1e3, records[i].latency * 1e3,
                    records[i].output_tokens, bench::time_per_output_token(records[i]) * 1e3);
    bench::Slo slo = bench::parse_slo("ttft:200,tpot:100");
    bench::Metrics m = bench::compute_metrics(records, 2.0, slo);
    std::printf("TTFT mean %.0f ms, median %.0f ms, p90 %.0f ms (rank 0.9*4 = 3.6 between 200 and 800 ms), p99 %.0f ms\n",
                m.ttft_ms.mean, m.ttft_ms.median, m.ttft_ms.p90, m.ttft_ms.p99);
    std::printf("TPOT over the %zu requests with more than one token: mean %.1f ms; ITL over all %zu gaps: mean %.1f ms\n",
                m.tpot_ms.count, m.tpot_ms.mean, m.itl_ms.count, m.itl_ms.mean);
    std::printf("throughput %.2f req/s, %.1f output tok/s; goodput under %s: %d of %d good, %.2f req/s\n\n",
                m.request_throughput, m.output_throughput, bench::slo_text(slo).c_str(), m.good, m.completed, m.request_goodput);

    // ---- The engine, in process: no HTTP, so these are the engine's own latencies.
    infer::Model model = line.has("-m") ? infer::load_model(line.text("-m")) : infer::demo_model();
    if (!line.has("-m")) std::cerr << "note: no -m given, so this runs the built-in demo model (random weights; the timing is real)\n";
    infer::ThreadPool pool(static_cast<int>(line.integer("-t", 0, 0, 1024)));
    const int input = static_cast<int>(line.integer("--input-len", 32, 1, 1 << 20));
    const int output = static_cast<int>(line.integer("--output-len", 32, 2, 1 << 20));
    if (input + output > model.config.context_length)
        throw infer::Error("--input-len + --output-len exceed the model's context of " + std::to_string(model.config.context_length));
    bench::run_engine(model, pool, 1, 4, 2);  // warm-up: pages the weights in
    std::printf("engine, %d prompt + %d output tokens per request, all added at once:\n", input, output);
    std::printf("| batch | output tok/s | TTFT mean ms | TPOT mean ms | TPOT p99 ms | E2E mean ms |\n"
                "|------:|-------------:|-------------:|-------------:|------------:|------------:|\n");
    for (int batch : {1, 4, 16}) {
        bench::EngineRun run = bench::run_engine(model, pool, batch, input, output);
        bench::Metrics e = bench::compute_metrics(run.records, run.seconds);
        std::printf("| %5d | %12.1f | %12.2f | %12.3f | %11.3f | %11.2f |\n", batch, e.output_throughput, e.ttft_ms.mean,
                    e.tpot_ms.mean, e.tpot_ms.p99, e.e2el_ms.mean);
    }
    return 0;
} catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
}
