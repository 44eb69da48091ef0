// bench.hpp — the benchmarking layer's arithmetic, kept apart from any network code so the tests can check it exactly:
// serving metrics as vLLM's `bench serve` defines them (TTFT, TPOT, ITL, end-to-end latency; mean, median, std, p90,
// p99; throughput and goodput under an SLO), the knee of a rate sweep, the datasets and arrival processes of a load
// generator, the per-layer breakdown table a server's `infer_timing` adds up to, an in-process engine benchmark, the
// roofline probes (memory bandwidth, peak FLOP/s, a forward pass's achieved figures) and a small SVG chart writer.
// Standard library and infer.hpp only; `infer bench ...` (tools/bench.cpp) adds the HTTP client.  (chapter 07, 10)
//
// Conventions, checked against vLLM's benchmarks/benchmark_serving.py (now `vllm bench serve`):
//   TTFT  time from sending the request to the first chunk that carries a token.
//   ITL   every gap between two consecutive token-carrying chunks, pooled over all requests.
//   TPOT  per request, (e2e − TTFT) / (output tokens − 1), only for requests with more than one output token.
//   E2E   time from sending to the last token-carrying chunk ("e2el" in vLLM's report).
//   Percentiles: numpy.percentile's default, linear interpolation between closest ranks: rank p/100·(n−1).
//   Goodput: completed requests per second whose TTFT, TPOT and E2E are each ≤ its SLO (missing SLOs are not checked;
//   a request with one output token has TPOT 0, as vLLM counts it).
//   Throughputs divide by the benchmark's duration: first request sent to last response done.
#pragma once

#include "command_line.hpp"
#include "infer.hpp"
#include "measure.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iomanip>
#include <limits>
#include <map>
#include <numeric>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>


namespace bench {

// =====================================================================================================================
// Statistics
// =====================================================================================================================

// numpy.percentile(values, p) with its default method ("linear"): sort, take rank p/100·(n−1) and interpolate between
// the two closest ranks with numpy's own lerp (which computes from the nearer end, so p50 of two values is exact).
// An empty list gives 0, as vLLM's `np.percentile(ttfts or 0, p)` does.
inline double percentile(std::vector<double> values, double p) {
    if (values.empty()) return 0;
    if (p < 0 || p > 100) infer::fail("percentile ", p, " is outside 0..100");
    std::sort(values.begin(), values.end());
    const double rank = p / 100 * static_cast<double>(values.size() - 1);
    const size_t below = static_cast<size_t>(std::floor(rank));
    const size_t above = std::min(below + 1, values.size() - 1);
    const double t = rank - static_cast<double>(below), a = values[below], b = values[above];
    const double difference = b - a;
    return t >= 0.5 ? b - difference * (1 - t) : a + difference * t;
}

// What a report prints for one metric, in the unit of the values given.
struct Summary {
    double mean = 0, median = 0, std = 0, p90 = 0, p99 = 0;
    size_t count = 0;
};

// Mean and std (population, numpy's default ddof=0) of an empty list are 0, as vLLM's `np.mean(ttfts or 0)`.
inline Summary summarize(const std::vector<double>& values) {
    Summary s;
    s.count = values.size();
    if (values.empty()) return s;
    s.mean = std::accumulate(values.begin(), values.end(), 0.0) / static_cast<double>(values.size());
    double squares = 0;
    for (double v : values) squares += (v - s.mean) * (v - s.mean);
    s.std = std::sqrt(squares / static_cast<double>(values.size()));
    s.median = percentile(values, 50);
    s.p90 = percentile(values, 90);
    s.p99 = percentile(values, 99);
    return s;
}

// =====================================================================================================================
// One request as the client saw it, and the server's account of it
// =====================================================================================================================

// The layers a server reports in its `infer_timing` extension field ("<layer>_ms"), in the order a request meets
// them; "other" is the server's own remainder (its e2e minus the layers it timed). e2e_ms is the server's total, not
// a layer. A layer the server leaves out counts 0, so a server that predates a layer still reads. Route is the
// router's choice alone; step_wait is the time the request then waits for the engine loop to end the step it is in
// before the engine takes it. http_parse, tokenize, route, step_wait and prefill happen before the first token.
// Queue is the engine's waiting time over the request's whole life (before admission, and between the steps it runs
// in), and the server does not split it at the first token: the TTFT table gives queue what is left of the measured
// TTFT after the other five, up to the queue's total (see compute_breakdown).
inline constexpr size_t layer_count = 12;
inline constexpr std::array<const char*, layer_count> layer_names = {
    "http_parse", "tokenize", "route", "step_wait", "queue", "schedule", "prefill", "decode", "sample", "detokenize",
    "http_write", "other"};
inline constexpr std::array<bool, layer_count> layer_before_first_token = {true, true, true, true, true, false, true,
                                                                           false, false, false, false, false};

// The position of a layer in layer_names (layer_count if it is not one), so code names layers rather than counting.
inline constexpr size_t layer_index(std::string_view name) {
    for (size_t i = 0; i < layer_count; ++i)
        if (std::string_view(layer_names[i]) == name) return i;
    return layer_count;
}

struct LayerTiming {
    std::array<double, layer_count> ms{};  // in layer_names order
    double e2e_ms = 0;           // the server's measured total
    double sum() const { return std::accumulate(ms.begin(), ms.end(), 0.0); }
};

// Times in seconds from the moment the request was sent.
struct RequestRecord {
    bool success = false;
    std::string error;
    double start = 0;             // when it was sent, seconds since the benchmark began
    double ttft = 0;              // first token-carrying chunk
    double latency = 0;           // last token-carrying chunk (vLLM's e2el)
    double done = 0;              // the response fully read (what a server's e2e_ms should add up to)
    std::vector<double> itl;      // gaps between token-carrying chunks
    int prompt_tokens = 0;        // from usage, else the dataset's length
    int output_tokens = 0;        // from usage, else the token-carrying chunks counted
    std::optional<LayerTiming> timing;
};

// vLLM's TPOT of one request: the decode time spread over the tokens after the first. 0 for one output token.
inline double time_per_output_token(const RequestRecord& r) {
    return r.output_tokens > 1 ? (r.latency - r.ttft) / (r.output_tokens - 1) : 0.0;
}

// =====================================================================================================================
// SLOs and rates: parsed from the command line, every mistake named
// =====================================================================================================================

struct Slo {
    std::optional<double> ttft_ms, tpot_ms, e2e_ms;
    bool empty() const { return !ttft_ms && !tpot_ms && !e2e_ms; }
};

// A finite number (command_line.hpp's parse_number also takes "inf" and "nan", which no bench option means).
inline double parse_finite(const std::string& option, const std::string& text, const std::string& what) {
    const double value = parse_number(option, text, what);
    if (!std::isfinite(value)) infer::fail("option ", option, ": \"", text, "\" is not ", what);
    return value;
}

// "ttft:500,tpot:50,e2e:2000" in milliseconds (vLLM's --goodput takes "ttft:500 tpot:50 e2el:2000": both spellings).
inline Slo parse_slo(const std::string& text) {
    Slo slo;
    if (text.empty()) infer::fail("option --slo: empty; expected e.g. ttft:500,tpot:50,e2e:2000 (milliseconds)");
    std::string normalized = text;
    std::replace(normalized.begin(), normalized.end(), ' ', ',');
    std::stringstream in(normalized);
    std::string item;
    while (std::getline(in, item, ',')) {
        if (item.empty()) continue;
        size_t colon = item.find(':');
        if (colon == std::string::npos)
            infer::fail("option --slo: \"", item, "\" is not NAME:MILLISECONDS (names: ttft, tpot, e2e)");
        std::string name = item.substr(0, colon);
        double ms = parse_finite("--slo", item.substr(colon + 1), "a number of milliseconds");
        if (ms <= 0) infer::fail("option --slo: ", name, " must be a positive number of milliseconds, found ", ms);
        if (name == "ttft") slo.ttft_ms = ms;
        else if (name == "tpot") slo.tpot_ms = ms;
        else if (name == "e2e" || name == "e2el") slo.e2e_ms = ms;
        else infer::fail("option --slo: unknown metric \"", name, "\" (known: ttft, tpot, e2e)");
    }
    if (slo.empty()) infer::fail("option --slo: \"", text, "\" names no metric; expected e.g. ttft:500,tpot:50");
    return slo;
}

inline std::string slo_text(const Slo& slo) {
    std::ostringstream out;
    const char* sep = "";
    if (slo.ttft_ms) out << sep << "ttft:" << *slo.ttft_ms, sep = ",";
    if (slo.tpot_ms) out << sep << "tpot:" << *slo.tpot_ms, sep = ",";
    if (slo.e2e_ms) out << sep << "e2e:" << *slo.e2e_ms;
    return out.str();
}

// "4", "inf" or "1,2,4,8" requests per second; a sweep runs each in the order given.
inline std::vector<double> parse_rates(const std::string& text) {
    std::vector<double> rates;
    std::stringstream in(text);
    std::string item;
    while (std::getline(in, item, ',')) {
        double rate = item == "inf" ? std::numeric_limits<double>::infinity()
                                    : parse_finite("--rate", item, "a request rate (requests/s, or inf)");
        if (!(rate > 0)) infer::fail("option --rate: ", item, " must be positive (requests/s, or inf)");
        rates.push_back(rate);
    }
    if (rates.empty()) infer::fail("option --rate: empty; expected e.g. 4, inf or 1,2,4,8");
    return rates;
}

inline bool meets_slo(const RequestRecord& r, const Slo& slo) {
    if (!r.success) return false;
    if (slo.ttft_ms && r.ttft * 1e3 > *slo.ttft_ms) return false;
    if (slo.tpot_ms && time_per_output_token(r) * 1e3 > *slo.tpot_ms) return false;
    if (slo.e2e_ms && r.latency * 1e3 > *slo.e2e_ms) return false;
    return true;
}

// =====================================================================================================================
// Metrics of one run, named as vLLM's JSON report names them
// =====================================================================================================================

struct Metrics {
    double duration = 0;  // seconds
    int completed = 0, failed = 0, good = 0;
    int64_t total_input_tokens = 0, total_output_tokens = 0;
    double request_throughput = 0, request_goodput = 0, output_throughput = 0, total_token_throughput = 0;
    Summary ttft_ms, tpot_ms, itl_ms, e2el_ms;
};

inline std::vector<double> milliseconds(std::vector<double> seconds) {
    for (double& s : seconds) s *= 1e3;
    return seconds;
}

inline Metrics compute_metrics(const std::vector<RequestRecord>& records, double duration, const Slo& slo = {}) {
    Metrics m;
    m.duration = duration;
    std::vector<double> ttfts, tpots, itls, e2els;
    for (const RequestRecord& r : records) {
        if (!r.success) {
            ++m.failed;
            continue;
        }
        ++m.completed;
        m.total_input_tokens += r.prompt_tokens;
        m.total_output_tokens += r.output_tokens;
        ttfts.push_back(r.ttft);
        e2els.push_back(r.latency);
        if (r.output_tokens > 1) tpots.push_back(time_per_output_token(r));
        itls.insert(itls.end(), r.itl.begin(), r.itl.end());
        if (!slo.empty() && meets_slo(r, slo)) ++m.good;
    }
    if (slo.empty()) m.good = m.completed;
    if (duration > 0) {
        m.request_throughput = m.completed / duration;
        m.request_goodput = m.good / duration;
        m.output_throughput = static_cast<double>(m.total_output_tokens) / duration;
        m.total_token_throughput = static_cast<double>(m.total_input_tokens + m.total_output_tokens) / duration;
    }
    m.ttft_ms = summarize(milliseconds(ttfts));
    m.tpot_ms = summarize(milliseconds(tpots));
    m.itl_ms = summarize(milliseconds(itls));
    m.e2el_ms = summarize(milliseconds(e2els));
    return m;
}

// =====================================================================================================================
// The knee of a rate sweep
// =====================================================================================================================
// A sweep raises the offered rate until the server stops keeping up; the knee is the last rate before that bend: the
// most load the server takes while still serving as it did at lower rates. A rate bends when it is not met, or when
// its latency jumps. With an SLO, a rate is met when at least `attainment` of its requests are good (goodput ≥ 90% of
// throughput by default, the SLO-attainment convention of DistServe and of SGLang's bench_serving); without one, when
// the server keeps up: completed requests per second ≥ `attainment` × the rate offered, and none failed. A latency
// jump is a median TTFT or E2E at least `latency_jump` times the next lower rate's: a queue that has started to grow
// shows there while every request still meets a loose SLO. Medians, not p99s, so one unlucky request is no bend. The
// first bend in rate order counts (a noisy pass beyond it does not). When no rate bends there is no knee within the
// rates tested: the highest rate is only a lower bound on it, and the report says so rather than call it the knee.

inline constexpr double knee_attainment = 0.9, knee_latency_jump = 2.0;

struct SweepPoint {
    double rate = 0;  // offered requests/s (inf: all at once)
    Metrics metrics;
};

struct Knee {
    int index = -1;   // the knee, into the sweep as given; -1 when there is none
    int bend = -1;    // the first rate that bent, into the sweep as given; -1 when every rate tested kept up
    std::string why;  // what bent there
};

inline std::string rate_text(double rate) {
    if (std::isinf(rate)) return "inf";
    char text[32];
    std::snprintf(text, sizeof text, "%g", rate);
    return text;
}

inline bool sweep_point_met(const SweepPoint& point, bool have_slo, double attainment = knee_attainment) {
    const Metrics& m = point.metrics;
    if (m.completed == 0) return false;
    if (have_slo) return m.good >= attainment * (m.completed + m.failed);
    if (std::isinf(point.rate)) return m.failed == 0;
    return m.failed == 0 && m.request_throughput >= attainment * point.rate;
}

// What a sweep's rates are held to, as the report prints it.
inline std::string knee_criterion(const Slo& slo, double attainment = knee_attainment) {
    const std::string percent = std::to_string(static_cast<int>(std::lround(100 * attainment))) + "%";
    return slo.empty() ? "completed req/s >= " + percent + " of the offered rate, no failures"
                       : ">= " + percent + " of requests within the SLO " + slo_text(slo);
}

// The latency half of the rule, as the report prints it.
inline std::string latency_rule(double latency_jump = knee_latency_jump) {
    char text[80];
    std::snprintf(text, sizeof text, "no median TTFT or E2E rising %gx over the next lower rate's", latency_jump);
    return text;
}

// Why `point` bends, given the next lower rate's point (null for the lowest); empty when it does not.
inline std::string bend_reason(const SweepPoint& point, const SweepPoint* lower, bool have_slo,
                               double attainment = knee_attainment, double latency_jump = knee_latency_jump) {
    const Metrics& m = point.metrics;
    char text[160];
    if (!sweep_point_met(point, have_slo, attainment)) {
        const int percent = static_cast<int>(std::lround(100 * attainment));
        if (have_slo) std::snprintf(text, sizeof text, "%d of %d requests met the SLO, under %d%%", m.good, m.completed + m.failed, percent);
        else if (m.completed == 0) std::snprintf(text, sizeof text, "no request completed");
        else if (m.failed > 0) std::snprintf(text, sizeof text, "%d of %d requests failed", m.failed, m.completed + m.failed);
        else std::snprintf(text, sizeof text, "it completed %.2f req/s, under %d%% of the rate offered", m.request_throughput, percent);
        return text;
    }
    if (!lower) return "";
    for (auto [name, before, after] : {std::tuple{"TTFT", lower->metrics.ttft_ms.median, m.ttft_ms.median},
                                       std::tuple{"E2E", lower->metrics.e2el_ms.median, m.e2el_ms.median}})
        if (before > 0 && after >= latency_jump * before) {
            std::snprintf(text, sizeof text, "the median %s rose %.1fx, from %.2f to %.2f ms", name, after / before, before, after);
            return text;
        }
    return "";
}

inline Knee find_knee(const std::vector<SweepPoint>& points, bool have_slo, double attainment = knee_attainment,
                      double latency_jump = knee_latency_jump) {
    std::vector<size_t> order(points.size());
    std::iota(order.begin(), order.end(), size_t{0});
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return points[a].rate < points[b].rate; });
    for (size_t k = 0; k < order.size(); ++k) {
        const SweepPoint* lower = k > 0 ? &points[order[k - 1]] : nullptr;
        std::string why = bend_reason(points[order[k]], lower, have_slo, attainment, latency_jump);
        if (!why.empty()) return {k > 0 ? static_cast<int>(order[k - 1]) : -1, static_cast<int>(order[k]), why};
    }
    return {};
}

// The sweep's conclusion, one line. With no bend the highest rate is not named as the knee: the knee lies above it.
inline std::string knee_text(const std::vector<SweepPoint>& points, const Knee& knee, const std::string& criterion,
                             double latency_jump = knee_latency_jump) {
    if (knee.index >= 0)
        return "knee: " + rate_text(points[static_cast<size_t>(knee.index)].rate) + " requests/s (the last rate before " +
               rate_text(points[static_cast<size_t>(knee.bend)].rate) + " requests/s, where " + knee.why + ")";
    if (knee.bend >= 0) return "knee: none (even the lowest rate misses: " + criterion + ")";
    double highest = 0;
    for (const SweepPoint& p : points) highest = std::max(highest, p.rate);
    const std::string held = "every rate met " + criterion + ", with " + latency_rule(latency_jump);
    if (std::isinf(highest))
        return "knee: no knee up to inf requests/s (all at once): " + held + "; a larger --num-prompts loads it harder";
    return "knee: no knee up to " + rate_text(highest) + " requests/s: raise --rate (" + held + ")";
}

// =====================================================================================================================
// Datasets: what to send
// =====================================================================================================================

struct Prompt {
    std::vector<int> ids;  // a token-id prompt (random and shared-prefix datasets), or empty
    std::string text;      // a text prompt (JSONL, or ids decoded with a tokenizer)
    int prompt_tokens = 0; // the length the dataset meant (ids.size(), or unknown 0 for text)
    int output_tokens = 0; // max_tokens (with ignore_eos, the output length)
};

// vLLM's random dataset: each length drawn uniformly from [⌊L·(1−r)⌋, ⌈L·(1+r)⌉], the prompt a run of consecutive
// ids from a random offset, (offset + i) mod vocabulary, so no two prompts share a prefix and the prefix cache stays out
// of the figures. Ids start at `first_id` to skip the special tokens (unk, bos, eos) at the bottom of most vocabularies.
inline std::vector<Prompt> random_dataset(int count, int input_len, int output_len, double range_ratio, int vocab_size,
                                          uint64_t seed, int first_id = 3) {
    if (count <= 0) infer::fail("--num-prompts must be positive, found ", count);
    if (input_len <= 0 || output_len <= 0)
        infer::fail("--input-len and --output-len must be positive, found ", input_len, " and ", output_len);
    if (range_ratio < 0 || range_ratio >= 1) infer::fail("--range-ratio must be in [0, 1), found ", range_ratio);
    if (vocab_size <= first_id) infer::fail("vocabulary of ", vocab_size, " tokens is too small for a random prompt");
    std::mt19937_64 random(seed);
    auto length = [&](int mean) {
        int low = std::max(1, static_cast<int>(std::floor(mean * (1 - range_ratio))));
        int high = std::max(low, static_cast<int>(std::ceil(mean * (1 + range_ratio))));
        return std::uniform_int_distribution<int>(low, high)(random);
    };
    const int span = vocab_size - first_id;
    std::vector<Prompt> prompts(static_cast<size_t>(count));
    for (Prompt& p : prompts) {
        const int in = length(input_len);
        p.output_tokens = length(output_len);
        const int offset = std::uniform_int_distribution<int>(0, span - 1)(random);
        for (int i = 0; i < in; ++i) p.ids.push_back(first_id + (offset + i) % span);
        p.prompt_tokens = in;
    }
    return prompts;
}

// SGLang's generated-shared-prefix dataset: `groups` system prompts of `prefix_len` tokens, each followed by
// questions of `input_len` tokens; requests are interleaved across groups, as chat users of several apps would be.
// A prefix cache should serve all but the first request of each group its prefix.
inline std::vector<Prompt> shared_prefix_dataset(int count, int groups, int prefix_len, int input_len, int output_len,
                                                 int vocab_size, uint64_t seed, int first_id = 3) {
    if (groups <= 0 || prefix_len <= 0) infer::fail("shared-prefix dataset: --prefix-groups and --prefix-len must be positive");
    std::vector<Prompt> questions = random_dataset(count, input_len, output_len, 0.0, vocab_size, seed + 1, first_id);
    std::vector<Prompt> prefixes = random_dataset(groups, prefix_len, 1, 0.0, vocab_size, seed, first_id);
    for (int i = 0; i < count; ++i) {
        Prompt& q = questions[static_cast<size_t>(i)];
        std::vector<int> ids = prefixes[static_cast<size_t>(i % groups)].ids;
        ids.insert(ids.end(), q.ids.begin(), q.ids.end());
        q.ids = std::move(ids);
        q.prompt_tokens = static_cast<int>(q.ids.size());
    }
    return questions;
}

// One JSON object a line with a "prompt" (or "text") string and optionally "output_len"/"max_tokens"; blank lines are
// skipped. Taken in order and cycled if --num-prompts asks for more.
inline std::vector<Prompt> jsonl_dataset(const std::string& path, int count, int output_len) {
    std::ifstream in(path);
    if (!in) infer::fail("--dataset-path ", path, ": cannot open");
    std::vector<Prompt> file;
    std::string line;
    for (int number = 1; std::getline(in, line); ++number) {
        if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
        infer::Json json;
        try {
            json = infer::Json::parse(line, path);
        } catch (const infer::Error& e) {
            infer::fail(path, " line ", number, ": ", e.what());
        }
        if (!json.is_object()) infer::fail(path, " line ", number, ": expected a JSON object with a \"prompt\"");
        const infer::Json* prompt = json.find("prompt");
        if (!prompt) prompt = json.find("text");
        if (!prompt || !prompt->is_string()) infer::fail(path, " line ", number, ": no \"prompt\" string");
        Prompt p;
        p.text = prompt->as_string();
        p.output_tokens = output_len;
        for (const char* key : {"output_len", "max_tokens"})
            if (const infer::Json* n = json.find(key); n && n->is_number()) p.output_tokens = static_cast<int>(n->as_number());
        if (p.output_tokens <= 0) infer::fail(path, " line ", number, ": output length must be positive");
        file.push_back(std::move(p));
    }
    if (file.empty()) infer::fail("--dataset-path ", path, ": no prompts in the file");
    std::vector<Prompt> prompts;
    for (int i = 0; i < count; ++i) prompts.push_back(file[static_cast<size_t>(i) % file.size()]);
    return prompts;
}

// =====================================================================================================================
// Arrivals: when to send
// =====================================================================================================================
// vLLM's request generator: gaps drawn from a gamma distribution of shape `burstiness` and scale 1/(rate·burstiness),
// so the mean gap is 1/rate whatever the burstiness. Burstiness 1 is a Poisson process (exponential gaps); below 1
// requests come in bursts, above 1 more evenly. rate inf sends everything at once. Returns send times in seconds
// from the start; the first request goes at 0.
inline std::vector<double> arrival_times(int count, double rate, double burstiness, uint64_t seed) {
    if (!(burstiness > 0)) infer::fail("option --burstiness: must be positive, found ", burstiness);
    std::vector<double> times(static_cast<size_t>(std::max(count, 0)), 0.0);
    if (std::isinf(rate)) return times;
    std::mt19937_64 random(seed);
    std::gamma_distribution<double> gap(burstiness, 1.0 / (rate * burstiness));
    double t = 0;
    for (size_t i = 1; i < times.size(); ++i) times[i] = t += gap(random);
    return times;
}

// =====================================================================================================================
// The layer breakdown: where the requests' time went, and which layer to fix
// =====================================================================================================================

struct BreakdownRow {
    std::string layer;
    double mean_ms = 0;
    double share_of_ttft = -1;  // -1: not part of the time to first token
    double share_of_e2e = 0;
};

struct Breakdown {
    int requests = 0;                 // successful requests that carried a timing
    double mean_ttft_ms = 0, mean_e2e_ms = 0;  // as the client measured them (e2e: response fully read)
    std::vector<BreakdownRow> rows;   // the server's layers, then "client+network" (client-measured − server-accounted)
    std::string dominant_e2e, dominant_ttft, hint;
    double worst_sum_error = 0;       // max over requests of |Σ layers − client e2e| / client e2e
};

inline std::string layer_hint(const std::string& layer, bool of_ttft) {
    if (layer == "queue")
        return "requests wait for a free slot: the instance is past its capacity. Add capacity (infer serve "
               "--instances N) or fix routing so no instance queues while another idles.";
    if (layer == "prefill")
        return "prompt processing dominates: it is compute-bound (FLOP/s). Shorter or shared prompts (prefix cache), "
               "chunked prefill, or faster matmuls.";
    if (layer == "decode")
        return of_ttft ? "decode steps of other requests delay first tokens: cap the batch or chunk prefills in."
                       : "decode dominates: each step streams every weight, so it is memory-bandwidth-bound. Batch more "
                         "requests per step, use a smaller dtype (bf16), or faster memory (see infer bench roofline).";
    if (layer == "tokenize" || layer == "detokenize") return "the tokenizer is the bottleneck: profile it, cache encodings, or move it off the serving thread.";
    if (layer == "http_parse" || layer == "http_write") return "the HTTP framework dominates: fewer/larger writes, keep-alive, a faster server library.";
    if (layer == "route") return "routing dominates: the router's choice costs more than it saves.";
    if (layer == "step_wait")
        return "waiting for the engine's current step: steps are long (big batches or long prefills); a smaller "
               "--max-batch-tokens shortens them.";
    if (layer == "other") return "server time outside the timed layers: locks, thread hand-offs, allocation.";
    if (layer == "schedule") return "scheduling overhead dominates: the scheduler does too much per step.";
    if (layer == "sample") return "sampling dominates: a large vocabulary's sort for top-k/top-p; partial sorts help.";
    return "time outside the server: the network or the benchmark client itself (run the client elsewhere).";
}

inline Breakdown compute_breakdown(const std::vector<RequestRecord>& records) {
    Breakdown b;
    constexpr size_t queue = layer_index("queue");
    std::array<double, layer_count> sums{}, before_first{};
    double ttft_sum = 0, e2e_sum = 0, accounted_before_first = 0, accounted = 0;
    for (const RequestRecord& r : records) {
        if (!r.success || !r.timing) continue;
        ++b.requests;
        double fixed = 0;  // the layers wholly before the first token
        for (size_t i = 0; i < sums.size(); ++i) {
            sums[i] += r.timing->ms[i];
            if (layer_before_first_token[i] && i != queue) fixed += r.timing->ms[i], before_first[i] += r.timing->ms[i];
        }
        // The queue's share of this TTFT: what the other layers leave of it, at most the whole queue time.
        const double waited = std::clamp(r.ttft * 1e3 - fixed, 0.0, r.timing->ms[queue]);
        before_first[queue] += waited;
        accounted_before_first += fixed + waited;
        accounted += r.timing->sum();
        ttft_sum += r.ttft * 1e3;
        e2e_sum += r.done * 1e3;
        if (r.done > 0) b.worst_sum_error = std::max(b.worst_sum_error, std::abs(r.timing->sum() - r.done * 1e3) / (r.done * 1e3));
    }
    if (b.requests == 0) return b;
    const double n = b.requests;
    b.mean_ttft_ms = ttft_sum / n;
    b.mean_e2e_ms = e2e_sum / n;
    for (size_t i = 0; i < sums.size(); ++i)
        b.rows.push_back({layer_names[i], sums[i] / n, layer_before_first_token[i] && ttft_sum > 0 ? before_first[i] / ttft_sum : -1,
                          e2e_sum > 0 ? sums[i] / e2e_sum : 0});
    b.rows.push_back({"client+network", (e2e_sum - accounted) / n, ttft_sum > 0 ? (ttft_sum - accounted_before_first) / ttft_sum : -1,
                      e2e_sum > 0 ? (e2e_sum - accounted) / e2e_sum : 0});
    auto largest = [&](bool ttft) {
        const BreakdownRow* best = nullptr;
        for (const BreakdownRow& row : b.rows) {
            double share = ttft ? row.share_of_ttft : row.share_of_e2e;
            if (share >= 0 && (!best || share > (ttft ? best->share_of_ttft : best->share_of_e2e))) best = &row;
        }
        return best ? best->layer : std::string();
    };
    b.dominant_e2e = largest(false);
    b.dominant_ttft = largest(true);
    b.hint = "TTFT: " + b.dominant_ttft + " — " + layer_hint(b.dominant_ttft, true) + "\nend to end: " + b.dominant_e2e +
             " — " + layer_hint(b.dominant_e2e, false);
    return b;
}

inline void print_breakdown(std::ostream& out, const Breakdown& b) {
    if (b.requests == 0) {
        out << "layer breakdown: the server sent no infer_timing field\n";
        return;
    }
    char line[160];
    std::snprintf(line, sizeof line, "layer breakdown over %d requests (mean TTFT %.2f ms, mean e2e %.2f ms, client-measured)\n",
                  b.requests, b.mean_ttft_ms, b.mean_e2e_ms);
    out << line;
    out << "| layer          |  mean ms | of TTFT | of e2e |\n|----------------|---------:|--------:|-------:|\n";
    for (const BreakdownRow& row : b.rows) {
        char ttft[16] = "      -";
        if (row.share_of_ttft >= 0) std::snprintf(ttft, sizeof ttft, "%6.1f%%", 100 * row.share_of_ttft);
        std::snprintf(line, sizeof line, "| %-14s | %8.3f | %s | %5.1f%% |\n", row.layer.c_str(), row.mean_ms, ttft,
                      100 * row.share_of_e2e);
        out << line;
    }
    std::snprintf(line, sizeof line, "the server's layers sum to each request's measured e2e within %.1f%% (worst request)\n",
                  100 * b.worst_sum_error);
    out << line << "dominant: " << b.hint << "\n";
}

// =====================================================================================================================
// SVG charts, written as text
// =====================================================================================================================

struct Series {
    std::string name;
    std::vector<std::pair<double, double>> points;
    bool line = true;     // joined by a line, else markers only
    bool labels = false;  // print each point's label next to its marker
    std::vector<std::string> point_labels;
};

struct Rect {  // a bar in data coordinates (the step timeline)
    double x0, x1, y0, y1;
    std::string color, title;
};

struct Chart {
    std::string title, x_label, y_label;
    bool log_x = false, log_y = false;
    std::vector<Series> series;
    std::vector<Rect> rects;
    std::vector<std::pair<std::string, std::string>> legend_rects;  // name, colour
    std::string inf_x_label;  // set: points at x = +inf are drawn past the finite x axis, at a tick with this label
};

inline std::string svg_escape(std::string_view text) {
    std::string out;
    for (char c : text) {
        if (c == '<') out += "&lt;";
        else if (c == '>') out += "&gt;";
        else if (c == '&') out += "&amp;";
        else if (c == '"') out += "&quot;";
        else out += c;
    }
    return out;
}

inline std::string format_tick(double v) {
    char text[32];
    if (v != 0 && (std::abs(v) >= 1e5 || std::abs(v) < 1e-3)) std::snprintf(text, sizeof text, "%.0e", v);
    else std::snprintf(text, sizeof text, "%g", v);
    return text;
}

// Axis ticks: powers of ten on a log axis, else 1/2/5 steps giving about five ticks.
inline std::vector<double> axis_ticks(double low, double high, bool log) {
    std::vector<double> ticks;
    if (log) {
        for (double t = std::pow(10, std::floor(std::log10(low))); t <= high * 1.0001; t *= 10)
            if (t >= low * 0.9999) ticks.push_back(t);
        return ticks;
    }
    double raw = (high - low) / 5, magnitude = std::pow(10, std::floor(std::log10(raw)));
    double step = magnitude * (raw / magnitude < 1.5 ? 1 : raw / magnitude < 3.5 ? 2 : raw / magnitude < 7.5 ? 5 : 10);
    for (double t = std::ceil(low / step) * step; t <= high + step * 1e-9; t += step) ticks.push_back(std::abs(t) < step * 1e-9 ? 0 : t);
    return ticks;
}

// The width of a label in the charts' 12 px sans-serif, estimated at 7 px a character (a UTF-8 continuation byte is
// not a character): generous for most glyphs, so a layout sized by it does not clip.
inline double text_width(std::string_view text) {
    double characters = 0;
    for (unsigned char c : text) characters += (c & 0xC0) != 0x80;
    return 7 * characters;
}

inline void write_svg(std::ostream& out, const Chart& chart) {
    static const char* colors[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"};
    const double plot_w = 500, height = 460, left = 80, top = 40, bottom = 60;
    // The legend (a 12 px swatch, then the name 30 px right of the plot) sets the right margin: the chart grows to
    // hold its longest name rather than clip it.
    double legend_w = 0;
    for (const Series& s : chart.series) legend_w = std::max(legend_w, text_width(s.name));
    for (const auto& [name, color] : chart.legend_rects) legend_w = std::max(legend_w, text_width(name));
    const double right = std::max(180.0, 30 + legend_w + 10), width = left + plot_w + right;
    const bool inf_x_shown = !chart.inf_x_label.empty();
    auto shown = [&](double x, double y) {
        const bool x_ok = std::isfinite(x) || (inf_x_shown && x > 0 && std::isinf(x));
        return x_ok && std::isfinite(y) && !(chart.log_x && x <= 0) && !(chart.log_y && y <= 0);
    };
    bool has_inf_x = false;
    double x_low = std::numeric_limits<double>::infinity(), x_high = -x_low, y_low = x_low, y_high = -x_low;
    auto extend = [&](double x, double y) {
        if (!shown(x, y)) return;
        if (std::isinf(x)) has_inf_x = true;
        else x_low = std::min(x_low, x), x_high = std::max(x_high, x);
        y_low = std::min(y_low, y), y_high = std::max(y_high, y);
    };
    for (const Series& s : chart.series)
        for (auto [x, y] : s.points) extend(x, y);
    for (const Rect& r : chart.rects) extend(r.x0, r.y0), extend(r.x1, r.y1);
    if (!std::isfinite(x_low)) x_low = chart.log_x ? 1 : 0, x_high = x_low + 1;
    if (!std::isfinite(y_low)) y_low = chart.log_y ? 1 : 0, y_high = y_low + 1;
    if (!chart.log_y && y_low > 0) y_low = 0;  // linear charts start at zero, so heights compare honestly
    if (!chart.log_x && x_low > 0 && chart.rects.empty()) x_low = 0;
    if (chart.log_x) x_low = std::pow(10, std::floor(std::log10(x_low))), x_high = std::pow(10, std::ceil(std::log10(x_high)));
    if (chart.log_y) y_low = std::pow(10, std::floor(std::log10(y_low))), y_high = std::pow(10, std::ceil(std::log10(y_high)));
    if (x_high <= x_low) x_high = x_low + (chart.log_x ? x_low * 9 : 1);
    if (y_high <= y_low) y_high = y_low + (chart.log_y ? y_low * 9 : 1);
    if (!chart.log_y) y_high *= 1.05;
    const double plot_h = height - top - bottom;
    // An x of +inf has no place on the axis: it gets the last 60 px of the plot, past the largest finite x.
    const double finite_w = has_inf_x ? plot_w - 60 : plot_w, inf_x = left + plot_w - 30;
    auto px = [&](double x) {
        if (std::isinf(x)) return inf_x;
        double f = chart.log_x ? std::log10(x / x_low) / std::log10(x_high / x_low) : (x - x_low) / (x_high - x_low);
        return left + finite_w * f;
    };
    auto py = [&](double y) {
        double f = chart.log_y ? std::log10(y / y_low) / std::log10(y_high / y_low) : (y - y_low) / (y_high - y_low);
        return top + plot_h * (1 - f);
    };
    out << std::fixed << std::setprecision(1);
    out << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << width << "\" height=\"" << height
        << "\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
    out << "<text x=\"" << width / 2 << "\" y=\"22\" text-anchor=\"middle\" font-size=\"15\">" << svg_escape(chart.title) << "</text>\n";
    for (double t : axis_ticks(x_low, x_high, chart.log_x)) {
        out << "<line x1=\"" << px(t) << "\" y1=\"" << top << "\" x2=\"" << px(t) << "\" y2=\"" << top + plot_h
            << "\" stroke=\"#ddd\"/>\n<text x=\"" << px(t) << "\" y=\"" << top + plot_h + 16 << "\" text-anchor=\"middle\">"
            << format_tick(t) << "</text>\n";
    }
    if (has_inf_x)
        out << "<line x1=\"" << inf_x << "\" y1=\"" << top << "\" x2=\"" << inf_x << "\" y2=\"" << top + plot_h
            << "\" stroke=\"#ddd\"/>\n<text x=\"" << inf_x << "\" y=\"" << top + plot_h + 16 << "\" text-anchor=\"middle\">"
            << svg_escape(chart.inf_x_label) << "</text>\n";
    for (double t : axis_ticks(y_low, y_high, chart.log_y)) {
        out << "<line x1=\"" << left << "\" y1=\"" << py(t) << "\" x2=\"" << left + plot_w << "\" y2=\"" << py(t)
            << "\" stroke=\"#ddd\"/>\n<text x=\"" << left - 6 << "\" y=\"" << py(t) + 4 << "\" text-anchor=\"end\">"
            << format_tick(t) << "</text>\n";
    }
    out << "<rect x=\"" << left << "\" y=\"" << top << "\" width=\"" << plot_w << "\" height=\"" << plot_h
        << "\" fill=\"none\" stroke=\"black\"/>\n";
    out << "<text x=\"" << left + plot_w / 2 << "\" y=\"" << height - 18 << "\" text-anchor=\"middle\">" << svg_escape(chart.x_label) << "</text>\n";
    out << "<text transform=\"translate(18," << top + plot_h / 2 << ") rotate(-90)\" text-anchor=\"middle\">"
        << svg_escape(chart.y_label) << "</text>\n";
    for (const Rect& r : chart.rects) {
        double x0 = px(r.x0), x1 = px(r.x1), y0 = py(r.y0), y1 = py(r.y1);
        out << "<rect x=\"" << x0 << "\" y=\"" << std::min(y0, y1) << "\" width=\"" << std::max(0.3, x1 - x0) << "\" height=\""
            << std::abs(y1 - y0) << "\" fill=\"" << r.color << "\"><title>" << svg_escape(r.title) << "</title></rect>\n";
    }
    double legend_y = top + 10;
    for (size_t i = 0; i < chart.series.size(); ++i) {
        const Series& s = chart.series[i];
        const char* color = colors[i % std::size(colors)];
        std::vector<std::pair<double, double>> visible;
        for (auto [x, y] : s.points)
            if (shown(x, y)) visible.push_back({x, y});
        if (s.line && visible.size() > 1) {
            out << "<polyline fill=\"none\" stroke=\"" << color << "\" stroke-width=\"2\" points=\"";
            for (auto [x, y] : visible) out << px(x) << ',' << py(y) << ' ';
            out << "\"/>\n";
        }
        if (!s.line || visible.size() <= 20)
            for (size_t k = 0; k < visible.size(); ++k) {
                out << "<circle cx=\"" << px(visible[k].first) << "\" cy=\"" << py(visible[k].second) << "\" r=\"4\" fill=\"" << color << "\"/>\n";
                if (s.labels && k < s.point_labels.size())
                    out << "<text x=\"" << px(visible[k].first) + 6 << "\" y=\"" << py(visible[k].second) - 6 << "\" font-size=\"10\">"
                        << svg_escape(s.point_labels[k]) << "</text>\n";
            }
        out << "<rect x=\"" << left + plot_w + 12 << "\" y=\"" << legend_y - 9 << "\" width=\"12\" height=\"12\" fill=\"" << color
            << "\"/><text x=\"" << left + plot_w + 30 << "\" y=\"" << legend_y + 1 << "\">" << svg_escape(s.name) << "</text>\n";
        legend_y += 18;
    }
    for (const auto& [name, color] : chart.legend_rects) {
        out << "<rect x=\"" << left + plot_w + 12 << "\" y=\"" << legend_y - 9 << "\" width=\"12\" height=\"12\" fill=\"" << color
            << "\"/><text x=\"" << left + plot_w + 30 << "\" y=\"" << legend_y + 1 << "\">" << svg_escape(name) << "</text>\n";
        legend_y += 18;
    }
    out << "</svg>\n";
}

inline void write_svg_file(const std::string& path, const Chart& chart) {
    std::ofstream out(path);
    if (!out) infer::fail("cannot write ", path);
    write_svg(out, chart);
    infer::close_written_file(out, path);
}

// The empirical CDF of a metric: x the value, y the fraction of requests at or below it.
inline Series cdf_series(const std::string& name, std::vector<double> values) {
    std::sort(values.begin(), values.end());
    Series s{name, {}, true, false, {}};
    for (size_t i = 0; i < values.size(); ++i) s.points.push_back({values[i], static_cast<double>(i + 1) / values.size()});
    return s;
}

inline Chart latency_cdf_chart(const std::vector<RequestRecord>& records, const std::string& title) {
    std::vector<double> ttft, tpot, itl, e2e;
    for (const RequestRecord& r : records) {
        if (!r.success) continue;
        ttft.push_back(r.ttft * 1e3);
        e2e.push_back(r.latency * 1e3);
        if (r.output_tokens > 1) tpot.push_back(time_per_output_token(r) * 1e3);
        for (double gap : r.itl) itl.push_back(gap * 1e3);
    }
    Chart chart{title, "milliseconds (log)", "fraction of requests (ITL: of gaps)", true, false, {}, {}, {}, {}};
    chart.series = {cdf_series("TTFT", ttft), cdf_series("TPOT", tpot), cdf_series("ITL", itl), cdf_series("E2E", e2e)};
    return chart;
}

// Throughput against the offered rate, in increasing rate, so the lines read left to right; inf (all at once), the
// load no finite rate reaches, at the right end.
inline Chart throughput_chart(std::vector<SweepPoint> points) {
    std::stable_sort(points.begin(), points.end(), [](const SweepPoint& a, const SweepPoint& b) { return a.rate < b.rate; });
    Chart chart{"throughput vs offered rate", "offered rate (requests/s; inf: all at once)", "tokens/s", false, false, {}, {}, {}, "inf"};
    Series output{"output tok/s", {}, true, false, {}}, total{"total tok/s", {}, true, false, {}};
    for (const SweepPoint& p : points) {
        output.points.push_back({p.rate, p.metrics.output_throughput});
        total.points.push_back({p.rate, p.metrics.total_token_throughput});
    }
    chart.series = {output, total};
    return chart;
}

// =====================================================================================================================
// Roofline: the machine's two ceilings, and where a forward pass sits under them
// =====================================================================================================================

// Peak FLOP/s: each thread runs independent chains of fused multiply-adds on registers, with no memory traffic, so
// only the FMA units limit it: 12 chains hide the FMA latency (4–5 cycles) on two FMA ports. The vectors are those of
// the kernels in use (infer::cpu_kernels(): 16 lanes for avx512, 8 for avx2), so the peak is the one they can reach.
namespace detail {
constexpr int peak_chains = 12;
constexpr int64_t peak_inner = 1 << 16;

// Each returns the multiply-adds it ran in `seconds`.
inline double fma_portable(double seconds) {
    float acc[peak_chains][8];
    for (int c = 0; c < peak_chains; ++c)
        for (int l = 0; l < 8; ++l) acc[c][l] = 1.0f + 1e-3f * (c * 8 + l);
    infer::Stopwatch clock;
    int64_t rounds = 0;
    do {
        for (int64_t i = 0; i < peak_inner; ++i)
            for (auto& chain : acc)
                for (float& v : chain) v = v * 0.999999f + 1e-6f;
        ++rounds;
    } while (clock.seconds() < seconds);
    float sum = 0;
    for (auto& chain : acc)
        for (float v : chain) sum += v;
    volatile float sink = sum;  // keeps every chain from being optimized away
    (void)sink;
    return 8.0 * peak_chains * peak_inner * static_cast<double>(rounds);
}

#ifdef INFER_X86_KERNELS
[[gnu::target("avx2,fma")]] inline double fma_avx2(double seconds) {
    __m256 r[peak_chains];
    for (int c = 0; c < peak_chains; ++c) r[c] = _mm256_set1_ps(1.0f + 1e-3f * c);
    const __m256 mul = _mm256_set1_ps(0.999999f), add = _mm256_set1_ps(1e-6f);
    infer::Stopwatch clock;
    int64_t rounds = 0;
    do {
        for (int64_t i = 0; i < peak_inner; ++i)
            for (int c = 0; c < peak_chains; ++c) r[c] = _mm256_fmadd_ps(r[c], mul, add);
        ++rounds;
    } while (clock.seconds() < seconds);
    for (int c = 1; c < peak_chains; ++c) r[0] = _mm256_add_ps(r[0], r[c]);  // every chain's result is used
    float lanes[8];
    _mm256_storeu_ps(lanes, r[0]);
    volatile float sink = lanes[0];
    (void)sink;
    return 8.0 * peak_chains * peak_inner * static_cast<double>(rounds);
}

[[gnu::target("avx512f,avx2,fma")]] inline double fma_avx512(double seconds) {
    __m512 r[peak_chains];
    for (int c = 0; c < peak_chains; ++c) r[c] = _mm512_set1_ps(1.0f + 1e-3f * c);
    const __m512 mul = _mm512_set1_ps(0.999999f), add = _mm512_set1_ps(1e-6f);
    infer::Stopwatch clock;
    int64_t rounds = 0;
    do {
        for (int64_t i = 0; i < peak_inner; ++i)
            for (int c = 0; c < peak_chains; ++c) r[c] = _mm512_fmadd_ps(r[c], mul, add);
        ++rounds;
    } while (clock.seconds() < seconds);
    for (int c = 1; c < peak_chains; ++c) r[0] = _mm512_add_ps(r[0], r[c]);  // every chain's result is used
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, r[0]);
    volatile float sink = lanes[0];
    (void)sink;
    return 16.0 * peak_chains * peak_inner * static_cast<double>(rounds);
}
#endif
}  // namespace detail

inline double peak_flops(infer::ThreadPool& pool, double seconds_per_thread = 0.2) {
    std::vector<double> rates(static_cast<size_t>(pool.size()), 0.0);
    const infer::CpuKernels kernels = infer::cpu_kernels();
    pool.run(static_cast<size_t>(pool.size()), [&](size_t begin, size_t end, int thread) {
        if (begin == end) return;
        infer::Stopwatch clock;
        double multiply_adds = 0;
#ifdef INFER_X86_KERNELS
        if (kernels == infer::CpuKernels::Avx512) multiply_adds = detail::fma_avx512(seconds_per_thread);
        else if (kernels == infer::CpuKernels::Avx2) multiply_adds = detail::fma_avx2(seconds_per_thread);
        else multiply_adds = detail::fma_portable(seconds_per_thread);
#else
        multiply_adds = detail::fma_portable(seconds_per_thread);
#endif
        rates[static_cast<size_t>(thread)] = 2.0 * multiply_adds / clock.seconds();
    });
    return std::accumulate(rates.begin(), rates.end(), 0.0);
}

// The work of one forward pass: FLOPs (a multiply-add is two) of the matmuls and attention, and the bytes of weights
// it reads (each matrix once per pass, however many tokens: the reason batching pays).
struct ForwardCost {
    double flops = 0, weight_bytes = 0, kv_bytes = 0;
};

// `positions[t]` is the position of token t (it attends over positions 0..positions[t]); `logit_rows` the rows that
// need the classifier; `kv_tokens` the cached tokens the pass touches, each counted once (a sequence's K/V are read
// from memory once per pass, then reused from cache by its other tokens' attention).
inline ForwardCost forward_cost(const infer::Model& model, const std::vector<int>& positions, int logit_rows, int kv_tokens) {
    const infer::ModelConfig& c = model.config;
    double matrix_parameters = 0;
    for (const infer::LayerWeights& layer : model.layers)
        for (const infer::Tensor* t : {&layer.wq, &layer.wk, &layer.wv, &layer.wo, &layer.w_gate, &layer.w_up, &layer.w_down})
            if (!t->empty()) matrix_parameters += static_cast<double>(t->elements());
    ForwardCost cost;
    double seen = 0;
    for (int p : positions) seen += p + 1;
    cost.flops = 2 * matrix_parameters * static_cast<double>(positions.size()) +
                 2.0 * c.vocab_size * c.dim * logit_rows +
                 4.0 * c.n_layers * c.n_heads * c.head_dim * seen;  // q·k and p·v over every position seen
    cost.weight_bytes = static_cast<double>(model.weight_bytes_per_token());
    cost.kv_bytes = static_cast<double>(infer::KVCache::bytes_per_token(c)) * kv_tokens;
    return cost;
}

struct RooflinePoint {
    std::string phase;  // "prefill" or "decode"
    int sequences = 0, tokens = 0;  // sequences in the pass, tokens in the pass
    double seconds = 0;             // best pass
    ForwardCost cost;
    double intensity() const { return cost.flops / (cost.weight_bytes + cost.kv_bytes); }
    double gflops() const { return cost.flops / seconds / 1e9; }
    double gbytes() const { return (cost.weight_bytes + cost.kv_bytes) / seconds / 1e9; }
};

struct Roofline {
    double bandwidth = 0;   // bytes/s
    double peak = 0;        // FLOP/s
    int threads = 0;
    std::vector<RooflinePoint> points;
    double ridge() const { return peak / bandwidth; }  // FLOPs per byte where the two roofs meet
    double attainable(double intensity) const { return std::min(peak, intensity * bandwidth); }
};

// Times one forward pass shape: prefill of `tokens` prompt tokens for each of `sequences` sequences, or (tokens == 1)
// one decode token each for `sequences` sequences with `context` tokens already cached. Best of `repeats`.
inline RooflinePoint time_forward(const infer::Model& model, infer::ThreadPool& pool, const std::string& phase,
                                  int sequences, int tokens, int context, int repeats) {
    const infer::ModelConfig& c = model.config;
    if (context + tokens > c.context_length)
        infer::fail("roofline: ", context + tokens, " positions exceed the model's context of ", c.context_length);
    infer::ForwardPass forward(model, pool);
    const int per_sequence = (context + tokens + 15) / 16;
    infer::KVCache cache(c, per_sequence * sequences + 1, 16);
    for (int s = 0; s < sequences; ++s) cache.reserve(s, context + tokens);
    infer::Batch batch;
    // The cached context: written once, untimed (its values do not matter to the cost).
    if (context > 0) {
        for (int s = 0; s < sequences; ++s)
            for (int i = 0; i < context; ++i) batch.add((7 * s + i) % c.vocab_size, i, s, false);
        for (size_t begin = 0; begin < batch.size(); begin += 512) {  // in chunks, as the scheduler would
            infer::Batch chunk;
            for (size_t i = begin; i < std::min(batch.size(), begin + 512); ++i)
                chunk.add(batch.tokens[i], batch.positions[i], batch.sequences[i], false);
            forward.forward(chunk, cache);
        }
    }
    batch.clear();
    std::vector<int> positions;
    for (int s = 0; s < sequences; ++s)
        for (int i = 0; i < tokens; ++i) {
            batch.add((11 * s + i) % c.vocab_size, context + i, s, i == tokens - 1);
            positions.push_back(context + i);
        }
    RooflinePoint point{phase, sequences, sequences * tokens, std::numeric_limits<double>::infinity(),
                        forward_cost(model, positions, sequences, sequences * (context + tokens))};
    forward.forward(batch, cache);  // warm-up: pages the weights in, sizes the buffers
    for (int r = 0; r < repeats; ++r) {
        infer::Stopwatch clock;
        forward.forward(batch, cache);  // rewrites the same K/V slots: same cost every time
        point.seconds = std::min(point.seconds, clock.seconds());
    }
    return point;
}

struct RooflineOptions {
    std::vector<int> prefill_tokens = {16, 64, 256};
    std::vector<int> decode_batches = {1, 4, 16, 64};
    int decode_context = 32;
    int repeats = 3;
    size_t bandwidth_bytes = size_t{256} << 20;
};

inline Roofline measure_roofline(const infer::Model& model, infer::ThreadPool& pool, const RooflineOptions& options) {
    Roofline roof;
    roof.threads = pool.size();
    roof.bandwidth = measure::memory_bandwidth(pool, options.bandwidth_bytes, 4).bytes_per_second;
    roof.peak = peak_flops(pool);
    for (int t : options.prefill_tokens)
        if (t <= model.config.context_length) roof.points.push_back(time_forward(model, pool, "prefill", 1, t, 0, options.repeats));
    for (int b : options.decode_batches)
        roof.points.push_back(time_forward(model, pool, "decode", b, 1,
                                           std::min(options.decode_context, model.config.context_length - 1), options.repeats));
    return roof;
}

inline std::string bound_of(const Roofline& roof, const RooflinePoint& p) {
    return p.intensity() < roof.ridge() ? "memory" : "compute";
}

inline void print_roofline(std::ostream& out, const Roofline& roof, const infer::Model& model) {
    char line[256];
    std::snprintf(line, sizeof line,
                  "machine: %d threads, %s kernels%s, memory bandwidth %.2f GB/s (streaming read), peak %.1f GFLOP/s (FMA), "
                  "ridge %.1f FLOP/byte\n",
                  roof.threads, infer::cpu_kernels_name(infer::cpu_kernels()),
                  infer::bf16_activations() ? ", bf16 activations" : "", roof.bandwidth / 1e9, roof.peak / 1e9, roof.ridge());
    out << line;
    // The model's source is a path of any length: it goes out as it is, not through the fixed buffer.
    std::snprintf(line, sizeof line, ", %.2f M parameters, %.2f MB of weights read per forward pass\n\n",
                  model.parameter_count() / 1e6, model.weight_bytes_per_token() / 1e6);
    out << "model: " << model.source << line;
    out << "| phase   | seqs | tokens |   ms/pass | FLOP/byte |  GFLOP/s |   GB/s | attainable GFLOP/s | of roof | bound   |\n"
           "|---------|-----:|-------:|----------:|----------:|---------:|-------:|-------------------:|--------:|---------|\n";
    for (const RooflinePoint& p : roof.points) {
        double attainable = roof.attainable(p.intensity());
        std::snprintf(line, sizeof line, "| %-7s | %4d | %6d | %9.3f | %9.2f | %8.2f | %6.2f | %18.2f | %6.1f%% | %-7s |\n",
                      p.phase.c_str(), p.sequences, p.tokens, p.seconds * 1e3, p.intensity(), p.gflops(), p.gbytes(),
                      attainable / 1e9, 100 * p.cost.flops / p.seconds / attainable, bound_of(roof, p).c_str());
        out << line;
    }
}

inline Chart roofline_chart(const Roofline& roof, const std::string& title) {
    Chart chart{title, "arithmetic intensity (FLOP per byte of weights and KV read)", "GFLOP/s", true, true, {}, {}, {}, {}};
    double low = 0.1, high = 1000;
    for (const RooflinePoint& p : roof.points) low = std::min(low, p.intensity() / 2), high = std::max(high, p.intensity() * 2);
    Series roofline{"roof: min(peak, AI × bandwidth)", {}, true, false, {}};
    for (double ai = low; ai <= high * 1.0001; ai *= 1.25) roofline.points.push_back({ai, roof.attainable(ai) / 1e9});
    roofline.points.push_back({roof.ridge(), roof.peak / 1e9});
    std::sort(roofline.points.begin(), roofline.points.end());
    chart.series.push_back(roofline);
    for (const char* phase : {"prefill", "decode"}) {
        Series s{std::string(phase) + " (measured)", {}, false, true, {}};
        for (const RooflinePoint& p : roof.points)
            if (p.phase == phase) {
                s.points.push_back({p.intensity(), p.gflops()});
                s.point_labels.push_back(p.phase == "prefill" ? "T=" + std::to_string(p.tokens) : "B=" + std::to_string(p.sequences));
            }
        chart.series.push_back(s);
    }
    return chart;
}

// =====================================================================================================================
// The engine benchmark: in process, no HTTP
// =====================================================================================================================
// B requests of I prompt tokens and O output tokens (ignore_eos, greedy) added at once to an Engine, stepped to the
// end. Latencies come from the engine's own clock (RequestTimes), so they hold only the engine's layers. With
// speculative decoding the run also counts the guesses drafted and kept.

struct EngineRun {
    int batch = 0, input_len = 0, output_len = 0;
    double seconds = 0;
    std::vector<RequestRecord> records;  // start 0, times from the engine
    std::vector<infer::StepStats> steps;
    int64_t draft_tokens = 0, accepted_tokens = 0, draft_steps = 0;  // speculative decoding, over all requests
    double output_throughput() const { return batch * static_cast<double>(output_len) / seconds; }
    double total_throughput() const { return batch * static_cast<double>(input_len + output_len) / seconds; }
};

inline EngineRun run_engine(const infer::Model& model, infer::ThreadPool& pool, int batch, int input_len, int output_len,
                            uint64_t seed = 0, int max_batch_tokens = 512, const infer::SpecConfig& spec = {},
                            infer::DType kv_dtype = infer::DType::F32) {
    infer::EngineConfig config;
    config.spec = spec;
    config.kv_dtype = kv_dtype;
    config.scheduler.max_seqs = std::max(batch, 1);
    config.scheduler.max_batch_tokens = std::max(max_batch_tokens, batch);
    config.num_blocks = batch * ((input_len + output_len + 15) / 16) + 1;
    config.prefix_caching = false;  // random prompts share nothing; keep the cache's bookkeeping out of the figures
    config.touch_kv_pool = true;    // the pool's page faults before the clock starts, as llama.cpp's benchmarks have them
    config.step_history = 0;        // the figures read every step of the run
    infer::Engine engine(model, pool, config);
    infer::SamplingParams params;
    params.temperature = 0;
    params.max_tokens = output_len;
    params.ignore_eos = true;
    std::vector<Prompt> prompts = random_dataset(batch, input_len, output_len, 0.0, model.config.vocab_size, seed);
    std::vector<int> ids;
    const double begin = engine.now();
    for (const Prompt& p : prompts) ids.push_back(engine.add_request(p.ids, params));
    while (engine.has_work()) engine.step();
    EngineRun run{batch, input_len, output_len, engine.now() - begin, {}, engine.steps()};
    for (int id : ids) {
        infer::RequestResult result = *engine.take_result(id);
        if (result.finish_reason == infer::FinishReason::Error) infer::fail("engine bench: ", result.error);
        const infer::RequestTimes& t = result.times;
        RequestRecord r;
        r.success = true;
        r.start = t.arrival - begin;
        r.ttft = t.first_token - t.arrival;
        r.latency = r.done = t.finished - t.arrival;
        for (size_t i = 1; i < t.token_times.size(); ++i) r.itl.push_back(t.token_times[i] - t.token_times[i - 1]);
        r.prompt_tokens = static_cast<int>(result.prompt_ids.size());
        r.output_tokens = static_cast<int>(result.generated_ids.size());
        run.records.push_back(std::move(r));
        run.draft_tokens += result.draft_tokens;
        run.accepted_tokens += result.accepted_tokens;
        run.draft_steps += result.draft_steps;
    }
    return run;
}

// The step timeline: one bar per engine step, its height the tokens it ran, coloured by how many were prefill.
inline Chart step_timeline_chart(const std::vector<infer::StepStats>& steps, const std::string& title) {
    Chart chart{title, "seconds since the engine started", "tokens in the step", false, false, {}, {}, {}, {}};
    for (const infer::StepStats& s : steps) {
        double end = s.start + s.schedule + s.forward + s.sample + s.detokenize;
        std::string what = std::to_string(s.prefill_tokens) + " prefill + " + std::to_string(s.decode_tokens) +
                           " decode tokens, " + std::to_string(s.sequences) + " sequences";
        if (s.decode_tokens > 0) chart.rects.push_back({s.start, end, 0, static_cast<double>(s.decode_tokens), "#1f77b4", what});
        if (s.prefill_tokens > 0)
            chart.rects.push_back({s.start, end, static_cast<double>(s.decode_tokens),
                                   static_cast<double>(s.decode_tokens + s.prefill_tokens), "#ff7f0e", what});
    }
    chart.legend_rects = {{"decode tokens", "#1f77b4"}, {"prefill tokens", "#ff7f0e"}};
    return chart;
}

}  // namespace bench
