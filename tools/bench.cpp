// bench.cpp — `infer bench serve|engine|roofline`, linked into the infer program as its own translation unit so the
// HTTP client (Debian's cpp-httplib and nlohmann-json) never reaches infer.hpp. The arithmetic is in bench.hpp.
//
//   infer bench serve --url URL [--rate R|inf|R1,R2,...] [--burstiness B] [--concurrency C] [--num-prompts N]
//                     [--dataset random|shared-prefix|jsonl] [--dataset-path FILE] [--input-len I] [--output-len O]
//                     [--range-ratio R] [--prefix-groups G] [--prefix-len P] [--seed S] [--warmup N]
//                     [--slo ttft:MS,tpot:MS,e2e:MS] [--json FILE] [--svg DIR] [--model NAME] [--tokenizer PATH]
//                     [--vocab-size V] [--endpoint PATH] [--timeout S] [--no-progress]
//   infer bench engine -m PATH [--batch 1,4,16] [--input-len 128] [--output-len 128] [-t N] [--svg DIR]
//                      [--spec ngram|draft] [--draft-model PATH] [--spec-k K] [--spec-ngram N] [--cache-type f32|f16|bf16]
//                      [--no-mmap]
//   infer bench roofline -m PATH [--prefill 16,64,256] [--decode-batch 1,4,16,64] [--context C] [--repeats N]
//                        [--bandwidth-mib M] [-t N] [--svg DIR] [--no-mmap]
//
// Built without cpp-httplib/nlohmann-json (INFER_BENCH_HTTP undefined), `bench serve` says which packages it needs.
#include "infer.hpp"
#include "bench.hpp"
#include "command_line.hpp"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <mutex>
#include <thread>

#ifdef INFER_BENCH_HTTP
#include <httplib.h>
#include <nlohmann/json.hpp>
#endif

namespace {

const char* bench_usage = R"(usage:
  infer bench serve --url URL [options]     load an OpenAI-compatible server (streaming /v1/completions)
      --rate R            requests/s: a number, inf (all at once, the default), or a sweep 1,2,4,8
      --burstiness B      gamma shape of the gaps (1 = Poisson, <1 burstier, >1 steadier; default 1)
      --concurrency C     at most C requests in flight (a closed loop with --rate inf; default unlimited)
      --num-prompts N     requests per rate (default 100)
      --dataset NAME      random (default), shared-prefix or jsonl (alias --dataset-name)
      --dataset-path FILE JSONL of {"prompt": ..., "output_len": N} for --dataset jsonl
      --input-len I       prompt tokens (default 128); shared-prefix: the question after the prefix
      --output-len O      output tokens, sent as max_tokens with ignore_eos (default 128)
      --range-ratio R     lengths drawn uniformly from [L(1-R), L(1+R)] (default 0)
      --prefix-groups G   shared-prefix: number of system prompts (default 4)
      --prefix-len P      shared-prefix: system prompt tokens (default 256)
      --seed S            dataset and arrival seed (default 0)
      --warmup N          requests sent one by one before timing, not counted (default 0)
      --slo LIST          goodput SLO in ms, e.g. ttft:500,tpot:50,e2e:2000; a sweep's knee uses it
      --json FILE         write the full report (metrics, every request, layer breakdown, knee)
      --svg DIR           write latency CDFs (and throughput vs rate for a sweep) as SVG
      --model NAME        model name in the requests (default: the first of GET /v1/models)
      --tokenizer PATH    a model or tokenizer: random prompts become text through it (else token-id prompts)
      --vocab-size V      id range of random prompts without --tokenizer (default 256)
      --endpoint PATH     default /v1/completions
      --timeout S         per-request read timeout in seconds (default 600)
      --no-progress       no progress bar on stderr
  infer bench engine -m PATH [--batch 1,4,16] [--input-len 128] [--output-len 128] [-t N] [--seed S] [--svg DIR]
                     [--spec ngram|draft] [--draft-model PATH] [--spec-k K] [--spec-ngram N]
                     [--cache-type f32|f16|bf16] [--no-mmap]
                                            the engine in process: throughput and latency per configuration;
                                            with --spec also the share of guesses kept and tokens per verifying step
  infer bench roofline -m PATH [--prefill 16,64,256] [--decode-batch 1,4,16,64] [--context 32] [--repeats 3]
                       [--bandwidth-mib 256] [-t N] [--svg DIR] [--no-mmap]
                                            memory bandwidth and peak FLOP/s of this machine, and where prefill
                                            and decode passes of the model sit under them
)";

int threads_option(const CommandLine& options) { return static_cast<int>(options.integer("-t", 0, 0, 1024)); }

void make_folder(const std::string& dir) {
    std::error_code error;
    std::filesystem::create_directories(dir, error);
    if (error) infer::fail("option --svg: cannot create ", dir, ": ", error.message());
}

using bench::rate_text;

// ---- bench engine ---------------------------------------------------------------------------------------------------

int run_engine_bench(const CommandLine& options) {
    if (!options.has("-m")) infer::fail("infer bench engine needs -m PATH");
    std::vector<int> batches = parse_int_list("--batch", options.text("--batch", "1,4,16"));
    std::vector<int> inputs = parse_int_list("--input-len", options.text("--input-len", "128"));
    std::vector<int> outputs = parse_int_list("--output-len", options.text("--output-len", "128"));
    const uint64_t seed = static_cast<uint64_t>(options.integer("--seed", 0, 0));
    infer::Model model = model_option(options);
    const infer::SpecConfig spec = spec_config(options);
    const infer::DType kv_dtype = cache_type(options);
    infer::ThreadPool pool(threads_option(options));
    for (int i : inputs)
        for (int o : outputs)
            if (i + o > model.config.context_length)
                infer::fail("--input-len ", i, " + --output-len ", o, " exceed the model's context of ",
                                    model.config.context_length, " tokens");
    std::printf("engine benchmark: %s, %d threads, greedy, ignore_eos, all requests added at once, KV cache %s",
                model.source.c_str(), pool.size(), infer::dtype_name(kv_dtype));
    if (spec.enabled())
        std::printf(", speculative %s k %d%s", infer::spec_method_name(spec.method), spec.k,
                    spec.draft_model ? (" (draft " + spec.draft_model->source + ")").c_str() : "");
    std::printf("\n\n| batch | input | output | seconds | output tok/s | total tok/s | TTFT mean ms | TTFT p99 ms "
                "| TPOT mean ms | TPOT p99 ms | ITL p99 ms | E2E mean ms |%s\n"
                "|------:|------:|-------:|--------:|-------------:|------------:|-------------:|------------:"
                "|-------------:|------------:|-----------:|------------:|%s\n",
                spec.enabled() ? " accepted | tokens/step |" : "", spec.enabled() ? "---------:|------------:|" : "");
    bench::run_engine(model, pool, 1, std::min(inputs[0], 8), 2, seed, 512, spec, kv_dtype);  // pages the weights in
    for (int i : inputs)
        for (int o : outputs)
            for (int b : batches) {
                bench::EngineRun run = bench::run_engine(model, pool, b, i, o, seed, 512, spec, kv_dtype);
                bench::Metrics m = bench::compute_metrics(run.records, run.seconds);
                std::printf("| %5d | %5d | %6d | %7.3f | %12.1f | %11.1f | %12.2f | %11.2f | %12.3f | %11.3f | %10.3f | %11.2f |",
                            b, i, o, run.seconds, m.output_throughput, m.total_token_throughput, m.ttft_ms.mean,
                            m.ttft_ms.p99, m.tpot_ms.mean, m.tpot_ms.p99, m.itl_ms.p99, m.e2el_ms.mean);
                if (spec.enabled())  // the share of guesses kept, and tokens per step that verified a draft
                    std::printf(" %7.1f%% | %11.2f |",
                                run.draft_tokens > 0 ? 100.0 * static_cast<double>(run.accepted_tokens) / static_cast<double>(run.draft_tokens) : 0.0,
                                run.draft_steps > 0 ? static_cast<double>(run.accepted_tokens + run.draft_steps) / static_cast<double>(run.draft_steps) : 0.0);
                std::printf("\n");
                std::fflush(stdout);
                if (options.has("--svg")) {
                    make_folder(options.text("--svg"));
                    const std::string tag = infer::concat("b", b, "_i", i, "_o", o);
                    bench::write_svg_file(options.text("--svg") + "/step_timeline_" + tag + ".svg",
                                          bench::step_timeline_chart(run.steps, "engine steps, batch " + std::to_string(b) +
                                                                                    ", input " + std::to_string(i) + ", output " + std::to_string(o)));
                    bench::write_svg_file(options.text("--svg") + "/latency_cdf_" + tag + ".svg",
                                          bench::latency_cdf_chart(run.records, "engine latencies, " + tag));
                }
            }
    return 0;
}

// ---- bench roofline -------------------------------------------------------------------------------------------------

int run_roofline_bench(const CommandLine& options) {
    if (!options.has("-m")) infer::fail("infer bench roofline needs -m PATH");
    bench::RooflineOptions ro;
    if (options.has("--prefill")) ro.prefill_tokens = parse_int_list("--prefill", options.text("--prefill"));
    if (options.has("--decode-batch")) ro.decode_batches = parse_int_list("--decode-batch", options.text("--decode-batch"));
    ro.decode_context = static_cast<int>(options.integer("--context", ro.decode_context, 0, 1 << 20));
    ro.repeats = static_cast<int>(options.integer("--repeats", ro.repeats, 1, 1000));
    ro.bandwidth_bytes = static_cast<size_t>(options.integer("--bandwidth-mib", 256, 16, 1 << 20)) << 20;
    infer::Model model = model_option(options);
    infer::ThreadPool pool(threads_option(options));
    bench::Roofline roof = bench::measure_roofline(model, pool, ro);
    bench::print_roofline(std::cout, roof, model);
    if (options.has("--svg")) {
        make_folder(options.text("--svg"));
        std::string path = options.text("--svg") + "/roofline.svg";
        bench::write_svg_file(path, bench::roofline_chart(roof, "roofline: " + std::filesystem::path(model.source).filename().string()));
        std::cerr << "wrote " << path << "\n";
    }
    return 0;
}

// ---- bench serve ----------------------------------------------------------------------------------------------------

#ifdef INFER_BENCH_HTTP

using Clock = std::chrono::steady_clock;
using nlohmann::json;

double seconds_between(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

struct ServeOptions {
    std::string url, endpoint = "/v1/completions", model;
    std::vector<double> rates;
    double burstiness = 1;
    int concurrency = 0;  // 0: unlimited
    int num_prompts = 100, warmup = 0;
    uint64_t seed = 0;
    bench::Slo slo;
    double timeout = 600;
    bool progress = true;
};

// One streamed request, timed as vLLM's client times it: TTFT at the first chunk carrying a choice, an ITL gap at
// each later one, the end-to-end latency at the last one. A final chunk with an empty text and a finish_reason
// carries no token, so it adds no ITL gap (vLLM would count it; our server sends one with the usage).
bench::RequestRecord send_request(const ServeOptions& o, const bench::Prompt& prompt, Clock::time_point t0) {
    bench::RequestRecord record;
    json body = {{"model", o.model}, {"max_tokens", prompt.output_tokens}, {"stream", true},
                 {"stream_options", {{"include_usage", true}}}, {"ignore_eos", true}, {"temperature", 0.0}};
    if (!prompt.text.empty()) body["prompt"] = prompt.text;
    else body["prompt"] = prompt.ids;
    record.prompt_tokens = prompt.prompt_tokens;

    httplib::Client client(o.url);
    client.set_connection_timeout(10);
    client.set_read_timeout(static_cast<time_t>(o.timeout), 0);
    httplib::Request request;
    request.method = "POST";
    request.path = o.endpoint;
    request.headers = {{"Content-Type", "application/json"}, {"Accept", "text/event-stream"}};
    request.body = body.dump();

    std::string pending, raw;
    bool first = false, usage_seen = false;
    int chunks = 0;
    Clock::time_point start = Clock::now(), last = start;
    auto handle_chunk = [&](const std::string& payload) {
        if (payload == "[DONE]") return;
        json chunk = json::parse(payload, nullptr, false);
        if (chunk.is_discarded() || !chunk.is_object()) {
            if (record.error.empty()) record.error = "not JSON in the stream: " + payload.substr(0, 200);
            return;
        }
        Clock::time_point now = Clock::now();
        if (chunk.contains("error")) record.error = chunk["error"].dump();
        if (chunk.contains("choices") && chunk["choices"].is_array() && !chunk["choices"].empty()) {
            const json& choice = chunk["choices"][0];
            std::string text;
            if (choice.contains("text") && choice["text"].is_string()) text = choice["text"];
            else if (choice.contains("delta") && choice["delta"].contains("content") && choice["delta"]["content"].is_string())
                text = choice["delta"]["content"];
            bool finished = choice.contains("finish_reason") && !choice["finish_reason"].is_null();
            if (!(text.empty() && finished)) {
                if (!first) record.ttft = seconds_between(start, now), first = true;
                else record.itl.push_back(seconds_between(last, now));
                last = now;
                ++chunks;
            }
        }
        if (chunk.contains("usage") && chunk["usage"].is_object()) {
            const json& usage = chunk["usage"];
            if (usage.contains("completion_tokens")) record.output_tokens = usage["completion_tokens"].get<int>(), usage_seen = true;
            if (usage.contains("prompt_tokens")) record.prompt_tokens = usage["prompt_tokens"].get<int>();
        }
        if (chunk.contains("infer_timing") && chunk["infer_timing"].is_object()) {
            const json& t = chunk["infer_timing"];
            bench::LayerTiming timing;
            for (size_t i = 0; i < bench::layer_names.size(); ++i)
                timing.ms[i] = t.value(std::string(bench::layer_names[i]) + "_ms", 0.0);
            timing.e2e_ms = t.value("e2e_ms", 0.0);
            record.timing = timing;
        }
    };
    // A field of the wrong type (a string where a count belongs) fails this request with the reason, not the run.
    auto handle = [&](const std::string& payload) {
        try {
            handle_chunk(payload);
        } catch (const json::exception& e) {
            if (record.error.empty()) record.error = std::string("unexpected chunk (") + e.what() + "): " + payload.substr(0, 200);
        }
    };
    request.content_receiver = [&](const char* data, size_t length, uint64_t, uint64_t) {
        raw.append(data, std::min<size_t>(length, raw.size() < 4096 ? length : 0));  // the start, for error messages
        pending.append(data, length);
        size_t end;
        while ((end = pending.find('\n')) != std::string::npos) {
            std::string line = pending.substr(0, end);
            pending.erase(0, end + 1);
            if (!line.empty() && line.back() == '\r') line.pop_back();
            if (line.rfind("data:", 0) == 0) handle(line.substr(line.size() > 5 && line[5] == ' ' ? 6 : 5));
        }
        return true;
    };
    record.start = seconds_between(t0, start);
    httplib::Response response;
    httplib::Error error = httplib::Error::Success;
    bool sent = client.send(request, response, error);
    record.done = seconds_between(start, Clock::now());
    if (!pending.empty() && pending.rfind("data:", 0) == 0) handle(pending.substr(pending.size() > 5 && pending[5] == ' ' ? 6 : 5));
    if (!sent) record.error = "HTTP: " + httplib::to_string(error);
    else if (response.status != 200) record.error = "HTTP " + std::to_string(response.status) + ": " + raw.substr(0, 300) + response.body.substr(0, 300);
    else if (!first && record.error.empty()) record.error = "the stream carried no token";
    record.success = record.error.empty() && first;
    record.latency = seconds_between(start, last);
    if (!usage_seen) record.output_tokens = chunks;
    return record;
}

// A progress bar on stderr, redrawn as requests finish.
class Progress {
public:
    Progress(int total, std::string label, bool enabled) : total_(total), label_(std::move(label)), enabled_(enabled) {}
    void finished(bool ok) {
        std::lock_guard lock(mutex_);
        ++done_, failed_ += !ok;
        if (!enabled_) return;
        const int width = 30, filled = total_ ? width * done_ / total_ : width;
        std::fprintf(stderr, "\r%s [%s%s] %d/%d%s %.1f s", label_.c_str(), std::string(filled, '#').c_str(),
                     std::string(width - filled, ' ').c_str(), done_, total_,
                     failed_ ? (" (" + std::to_string(failed_) + " failed)").c_str() : "", clock_.seconds());
        if (done_ == total_) std::fprintf(stderr, "\n");
        std::fflush(stderr);
    }

private:
    int total_, done_ = 0, failed_ = 0;
    std::string label_;
    bool enabled_;
    std::mutex mutex_;
    infer::Stopwatch clock_;
};

// One rate: requests sent at their arrival times, each on its own thread, at most `concurrency` in flight.
std::vector<bench::RequestRecord> run_rate(const ServeOptions& o, const std::vector<bench::Prompt>& prompts, double rate,
                                           double& duration) {
    std::vector<double> arrivals = bench::arrival_times(static_cast<int>(prompts.size()), rate, o.burstiness, o.seed);
    std::vector<bench::RequestRecord> records(prompts.size());
    Progress progress(static_cast<int>(prompts.size()), "rate " + rate_text(rate), o.progress);
    std::mutex mutex;
    std::condition_variable slot_free;
    int in_flight = 0;
    std::vector<std::thread> threads;
    const Clock::time_point t0 = Clock::now();
    for (size_t i = 0; i < prompts.size(); ++i) {
        std::this_thread::sleep_until(t0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(arrivals[i])));
        {
            std::unique_lock lock(mutex);
            slot_free.wait(lock, [&] { return o.concurrency <= 0 || in_flight < o.concurrency; });
            ++in_flight;
        }
        threads.emplace_back([&, i] {
            records[i] = send_request(o, prompts[i], t0);
            progress.finished(records[i].success);
            {
                std::lock_guard lock(mutex);
                --in_flight;
            }
            slot_free.notify_one();
        });
    }
    for (std::thread& t : threads) t.join();
    duration = seconds_between(t0, Clock::now());
    return records;
}

void print_metrics(const bench::Metrics& m, double rate, const ServeOptions& o) {
    auto row = [](const char* name, double value, int decimals = 2) { std::printf("%-40s %.*f\n", name, decimals, value); };
    auto summary = [&](const char* title, const char* name, const bench::Summary& s) {
        std::printf("%s\n", title);
        std::printf("%-40s %.2f\n", ("Mean " + std::string(name) + " (ms):").c_str(), s.mean);
        std::printf("%-40s %.2f\n", ("Median " + std::string(name) + " (ms):").c_str(), s.median);
        std::printf("%-40s %.2f\n", ("P90 " + std::string(name) + " (ms):").c_str(), s.p90);
        std::printf("%-40s %.2f\n", ("P99 " + std::string(name) + " (ms):").c_str(), s.p99);
    };
    std::printf("============ Serving Benchmark Result ============\n");
    std::printf("%-40s %s\n", "Request rate (req/s):", rate_text(rate).c_str());
    std::printf("%-40s %s\n", "Max concurrency:", o.concurrency > 0 ? std::to_string(o.concurrency).c_str() : "unlimited");
    std::printf("%-40s %d\n%-40s %d\n", "Successful requests:", m.completed, "Failed requests:", m.failed);
    row("Benchmark duration (s):", m.duration);
    std::printf("%-40s %lld\n%-40s %lld\n", "Total input tokens:", static_cast<long long>(m.total_input_tokens),
                "Total generated tokens:", static_cast<long long>(m.total_output_tokens));
    row("Request throughput (req/s):", m.request_throughput);
    if (!o.slo.empty()) row(("Request goodput (req/s) @" + bench::slo_text(o.slo) + ":").c_str(), m.request_goodput);
    row("Output token throughput (tok/s):", m.output_throughput);
    row("Total token throughput (tok/s):", m.total_token_throughput);
    summary("---------------Time to First Token----------------", "TTFT", m.ttft_ms);
    summary("-----Time per Output Token (excl. 1st token)------", "TPOT", m.tpot_ms);
    summary("---------------Inter-token Latency----------------", "ITL", m.itl_ms);
    summary("----------------End-to-end Latency----------------", "E2EL", m.e2el_ms);
    std::printf("==================================================\n");
}

json summary_json(json& out, const std::string& name, const bench::Summary& s) {
    out["mean_" + name + "_ms"] = s.mean;
    out["median_" + name + "_ms"] = s.median;
    out["std_" + name + "_ms"] = s.std;
    out["p90_" + name + "_ms"] = s.p90;
    out["p99_" + name + "_ms"] = s.p99;
    return out;
}

json run_json(double rate, const ServeOptions& o, const bench::Metrics& m, const bench::Breakdown& b,
              const std::vector<bench::RequestRecord>& records, bool met) {
    json out = {{"request_rate", std::isinf(rate) ? json("inf") : json(rate)},
                {"burstiness", o.burstiness},
                {"max_concurrency", o.concurrency > 0 ? json(o.concurrency) : json(nullptr)},
                {"duration", m.duration},
                {"completed", m.completed},
                {"failed", m.failed},
                {"total_input_tokens", m.total_input_tokens},
                {"total_output_tokens", m.total_output_tokens},
                {"request_throughput", m.request_throughput},
                {"request_goodput", o.slo.empty() ? json(nullptr) : json(m.request_goodput)},
                {"output_throughput", m.output_throughput},
                {"total_token_throughput", m.total_token_throughput},
                {"meets_slo", met}};
    summary_json(out, "ttft", m.ttft_ms);
    summary_json(out, "tpot", m.tpot_ms);
    summary_json(out, "itl", m.itl_ms);
    summary_json(out, "e2el", m.e2el_ms);
    json layers = json::array();
    for (const bench::BreakdownRow& row : b.rows)
        layers.push_back({{"layer", row.layer}, {"mean_ms", row.mean_ms},
                          {"share_of_ttft", row.share_of_ttft >= 0 ? json(row.share_of_ttft) : json(nullptr)},
                          {"share_of_e2e", row.share_of_e2e}});
    out["breakdown"] = {{"requests", b.requests}, {"mean_ttft_ms", b.mean_ttft_ms}, {"mean_e2e_ms", b.mean_e2e_ms},
                        {"layers", layers}, {"dominant_ttft", b.dominant_ttft}, {"dominant_e2e", b.dominant_e2e},
                        {"hint", b.hint}, {"worst_sum_error", b.worst_sum_error}};
    json requests = json::array();
    for (const bench::RequestRecord& r : records) {
        json item = {{"success", r.success}, {"start_s", r.start}, {"input_len", r.prompt_tokens},
                     {"output_len", r.output_tokens}, {"ttft_ms", r.ttft * 1e3}, {"tpot_ms", bench::time_per_output_token(r) * 1e3},
                     {"e2el_ms", r.latency * 1e3}, {"done_ms", r.done * 1e3}, {"itl_ms", bench::milliseconds(r.itl)},
                     {"error", r.error}};
        if (r.timing) {
            json timing;
            for (size_t i = 0; i < bench::layer_names.size(); ++i) timing[std::string(bench::layer_names[i]) + "_ms"] = r.timing->ms[i];
            timing["e2e_ms"] = r.timing->e2e_ms;
            item["infer_timing"] = timing;
        }
        requests.push_back(item);
    }
    out["requests"] = requests;
    return out;
}

std::string first_model(const std::string& url) {
    httplib::Client client(url);
    client.set_connection_timeout(5);
    client.set_read_timeout(10, 0);
    auto response = client.Get("/v1/models");
    if (response && response->status == 200) {
        json models = json::parse(response->body, nullptr, false);
        if (!models.is_discarded() && models.contains("data") && models["data"].is_array() && !models["data"].empty() &&
            models["data"][0].contains("id") && models["data"][0]["id"].is_string())
            return models["data"][0]["id"];
    }
    return "default";
}

int run_serve_bench(const CommandLine& options) {
    ServeOptions o;
    if (!options.has("--url")) infer::fail("infer bench serve needs --url URL (e.g. http://127.0.0.1:8000)");
    o.url = options.text("--url");
    if (o.url.rfind("http://", 0) != 0 && o.url.rfind("https://", 0) != 0)
        infer::fail("option --url: \"", o.url, "\" is not an http:// URL (e.g. http://127.0.0.1:8000)");
    while (!o.url.empty() && o.url.back() == '/') o.url.pop_back();
    o.endpoint = options.text("--endpoint", o.endpoint);
    o.rates = bench::parse_rates(options.text("--rate", "inf"));
    o.burstiness = options.number("--burstiness", 1.0);
    if (!(o.burstiness > 0)) infer::fail("option --burstiness: must be positive, found ", o.burstiness);
    o.concurrency = static_cast<int>(options.integer("--concurrency", 0, 0, 100000));
    o.num_prompts = static_cast<int>(options.integer("--num-prompts", 100, 1, 10'000'000));
    o.warmup = static_cast<int>(options.integer("--warmup", 0, 0, 100000));
    o.seed = static_cast<uint64_t>(options.integer("--seed", 0, 0));
    if (options.has("--slo")) o.slo = bench::parse_slo(options.text("--slo"));
    o.timeout = options.number("--timeout", 600);
    if (!(o.timeout > 0)) infer::fail("option --timeout: must be positive seconds");
    o.progress = !options.has("--no-progress");

    const std::string dataset = options.text("--dataset", options.text("--dataset-name", "random"));
    const int input_len = static_cast<int>(options.integer("--input-len", 128, 1, 10'000'000));
    const int output_len = static_cast<int>(options.integer("--output-len", 128, 1, 10'000'000));
    const double range_ratio = options.number("--range-ratio", 0.0);
    std::optional<infer::Tokenizer> tokenizer;
    int vocab = static_cast<int>(options.integer("--vocab-size", 256, 4, 100'000'000));
    if (options.has("--tokenizer")) {
        tokenizer = infer::load_tokenizer(options.text("--tokenizer"));
        vocab = tokenizer->vocab_size();
    }
    const int total = o.num_prompts + o.warmup;
    std::vector<bench::Prompt> prompts;
    if (dataset == "random") {
        prompts = bench::random_dataset(total, input_len, output_len, range_ratio, vocab, o.seed);
    } else if (dataset == "shared-prefix") {
        prompts = bench::shared_prefix_dataset(total, static_cast<int>(options.integer("--prefix-groups", 4, 1, 1 << 20)),
                                               static_cast<int>(options.integer("--prefix-len", 256, 1, 1 << 24)), input_len,
                                               output_len, vocab, o.seed);
    } else if (dataset == "jsonl") {
        std::string path = options.text("--dataset-path");
        if (path.empty()) infer::fail("--dataset jsonl needs --dataset-path FILE");
        prompts = bench::jsonl_dataset(path, total, output_len);
    } else {
        infer::fail("option --dataset: unknown dataset \"", dataset, "\" (random, shared-prefix or jsonl)");
    }
    if (tokenizer)  // vLLM's way: the ids become text, which the server tokenizes again (so tokenize shows up)
        for (bench::Prompt& p : prompts)
            if (p.text.empty()) p.text = tokenizer->decode(p.ids);
    o.model = options.text("--model", "");
    if (o.model.empty()) o.model = first_model(o.url);

    std::vector<bench::Prompt> warmups(prompts.begin(), prompts.begin() + o.warmup);
    prompts.erase(prompts.begin(), prompts.begin() + o.warmup);
    for (size_t i = 0; i < warmups.size(); ++i) {
        bench::RequestRecord r = send_request(o, warmups[i], Clock::now());
        if (!r.success) infer::fail("warm-up request failed: ", r.error);
    }

    json report = {{"config", {{"url", o.url}, {"endpoint", o.endpoint}, {"model", o.model}, {"dataset", dataset},
                               {"num_prompts", o.num_prompts}, {"input_len", input_len}, {"output_len", output_len},
                               {"range_ratio", range_ratio}, {"seed", o.seed}, {"warmup", o.warmup},
                               {"burstiness", o.burstiness}, {"max_concurrency", o.concurrency > 0 ? json(o.concurrency) : json(nullptr)},
                               {"slo", bench::slo_text(o.slo)},
                               {"percentiles", "numpy linear interpolation, rank p/100*(n-1)"}}},
                   {"runs", json::array()}};
    std::vector<bench::SweepPoint> sweep;
    int completed_total = 0;
    std::string first_error;
    for (double rate : o.rates) {
        double duration = 0;
        std::vector<bench::RequestRecord> records = run_rate(o, prompts, rate, duration);
        bench::Metrics m = bench::compute_metrics(records, duration, o.slo);
        bench::Breakdown b = bench::compute_breakdown(records);
        sweep.push_back({rate, m});
        bool met = bench::sweep_point_met(sweep.back(), !o.slo.empty());
        completed_total += m.completed;
        for (const bench::RequestRecord& r : records)
            if (!r.success && first_error.empty()) first_error = r.error;
        print_metrics(m, rate, o);
        bench::print_breakdown(std::cout, b);
        std::cout << std::endl;
        report["runs"].push_back(run_json(rate, o, m, b, records, met));
        if (options.has("--svg")) {
            make_folder(options.text("--svg"));
            bench::write_svg_file(options.text("--svg") + "/latency_cdf_rate_" + rate_text(rate) + ".svg",
                                  bench::latency_cdf_chart(records, "latency CDFs at " + rate_text(rate) + " requests/s"));
        }
    }
    if (sweep.size() > 1) {
        const bench::Knee knee = bench::find_knee(sweep, !o.slo.empty());
        std::printf("| rate req/s | req/s | goodput req/s | output tok/s | p99 TTFT ms | p99 TPOT ms | met |\n"
                    "|-----------:|------:|--------------:|-------------:|------------:|------------:|-----|\n");
        for (const bench::SweepPoint& p : sweep)
            std::printf("| %10s | %5.2f | %13.2f | %12.1f | %11.2f | %11.2f | %-3s |\n", rate_text(p.rate).c_str(),
                        p.metrics.request_throughput, p.metrics.request_goodput, p.metrics.output_throughput,
                        p.metrics.ttft_ms.p99, p.metrics.tpot_ms.p99, bench::sweep_point_met(p, !o.slo.empty()) ? "yes" : "no");
        const std::string criterion = bench::knee_criterion(o.slo);
        std::printf("%s\n", bench::knee_text(sweep, knee, criterion).c_str());
        const double knee_rate = knee.index >= 0 ? sweep[static_cast<size_t>(knee.index)].rate : 0;
        report["knee"] = {{"rate", knee.index < 0 ? json(nullptr) : std::isinf(knee_rate) ? json("inf") : json(knee_rate)},
                          {"criterion", criterion + ", with " + bench::latency_rule()}};
        if (options.has("--svg"))
            bench::write_svg_file(options.text("--svg") + "/throughput_vs_rate.svg", bench::throughput_chart(sweep));
    } else {
        report["knee"] = nullptr;
    }
    if (options.has("--json")) {
        std::ofstream file(options.text("--json"));
        if (!file) infer::fail("option --json: cannot write ", options.text("--json"));
        file << report.dump(2) << "\n";
        infer::close_written_file(file, options.text("--json"));
    }
    if (completed_total == 0) infer::fail("no request completed; the first error: ", first_error);
    return 0;
}

#else

int run_serve_bench(const CommandLine&) {
    infer::fail("infer bench serve was built without its HTTP client: install cpp-httplib and nlohmann-json "
                        "(Debian: apt-get install libcpp-httplib-dev nlohmann-json3-dev) and rebuild");
    return 1;
}

#endif

}  // namespace

// The entry point main.cpp dispatches `infer bench ...` to (argv[1] is "bench").
int run_bench(int argc, char** argv) {
    const std::string what = argc > 2 ? argv[2] : "";
    if (what == "serve")
        return run_serve_bench(CommandLine(argc, argv, 3,
            {"--url", "--endpoint", "--rate", "--burstiness", "--concurrency", "--num-prompts", "--dataset", "--dataset-name",
             "--dataset-path", "--input-len", "--output-len", "--range-ratio", "--prefix-groups", "--prefix-len", "--seed",
             "--warmup", "--slo", "--json", "--svg", "--model", "--tokenizer", "--vocab-size", "--timeout"},
            {"--no-progress"}, bench_usage));
    if (what == "engine")
        return run_engine_bench(CommandLine(argc, argv, 3,
            {"-m", "--tokenizer", "--batch", "--input-len", "--output-len", "-t", "--seed", "--svg", "--spec", "--draft-model",
             "--spec-k", "--spec-ngram", "--cache-type", "--cache-type-k", "--cache-type-v"}, {"--no-mmap"}, bench_usage));
    if (what == "roofline")
        return run_roofline_bench(CommandLine(argc, argv, 3,
            {"-m", "--tokenizer", "--prefill", "--decode-batch", "--context", "--repeats", "--bandwidth-mib", "-t", "--svg"},
            {"--no-mmap"}, bench_usage));
    if (what == "-h" || what == "--help" || what == "help") {
        std::cout << bench_usage;
        return 0;
    }
    infer::fail(what.empty() ? std::string("infer bench needs serve, engine or roofline") : "unknown bench \"" + what + "\"",
                        "\n", bench_usage);
    return 1;
}
