// The benchmarking layer: the serving metrics on synthetic timestamps against values worked out by hand from vLLM's
// and numpy's definitions (never against figures the code printed), `infer bench serve` end to end against a fake
// OpenAI streaming server on loopback (and, when built, a real `infer serve`), and the command line's error messages.
// Deterministic: no assertion depends on how fast anything ran.
#include "support.hpp"

#include "bench.hpp"

#include <algorithm>
#include <atomic>
#include <regex>
#include <thread>

#ifdef INFER_BENCH_HTTP
#include "serve_support.hpp"

#include <httplib.h>
#include <nlohmann/json.hpp>

#include <arpa/inet.h>
#include <csignal>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>
#endif

namespace {

bench::RequestRecord record(double ttft, double latency, int output_tokens, std::vector<double> itl = {}, int prompt = 10) {
    bench::RequestRecord r;
    r.success = true;
    r.ttft = ttft;
    r.latency = r.done = latency;
    r.output_tokens = output_tokens;
    r.prompt_tokens = prompt;
    r.itl = std::move(itl);
    return r;
}

}  // namespace

TEST_CASE("percentiles are numpy's linear interpolation") {
    // numpy.percentile(a, p): rank p/100·(n−1) between the sorted values (numpy docs, method="linear").
    CHECK(bench::percentile({4, 1, 2}, 50) == 2.0);
    CHECK(bench::percentile({4, 1, 2}, 75) == 3.0);  // rank 1.5: halfway between 2 and 4
    CHECK(bench::percentile({4, 1, 2}, 100) == 4.0);
    CHECK(bench::percentile({4, 1, 2}, 0) == 1.0);
    CHECK(bench::percentile({10, 20, 30, 40}, 50) == 25.0);
    CHECK(bench::percentile({10, 20, 30, 40}, 90) == doctest::Approx(37.0).epsilon(1e-12));  // rank 2.7
    CHECK(bench::percentile({10, 20, 30, 40}, 99) == doctest::Approx(39.7).epsilon(1e-12));  // rank 2.97
    CHECK(bench::percentile({7}, 99) == 7.0);
    CHECK(bench::percentile({}, 50) == 0.0);  // vLLM: np.percentile(x or 0, p)
    std::vector<double> hundred;
    for (int i = 100; i >= 0; --i) hundred.push_back(i);
    CHECK(bench::percentile(hundred, 90) == 90.0);
    CHECK(bench::percentile(hundred, 99) == 99.0);

    bench::Summary s = bench::summarize({1, 2, 3, 4});
    CHECK(s.mean == 2.5);
    CHECK(s.median == 2.5);
    CHECK(s.std == doctest::Approx(std::sqrt(1.25)).epsilon(1e-15));  // population std (ddof 0), as np.std
    CHECK(s.count == 4);
    CHECK(test::error_of([] { bench::percentile({1}, 101); }).find("outside 0..100") != std::string::npos);
}

TEST_CASE("TTFT, TPOT, ITL, E2E and throughput as vLLM computes them") {
    // Request A: first token at 0.25 s, 5 tokens, last at 1.25 s: TPOT (1.25 − 0.25)/(5 − 1) = 0.25 s.
    // Request B: first at 0.5 s, 3 tokens, last at 1.5 s: TPOT 0.5 s. Request C: one token: no TPOT. D failed.
    std::vector<bench::RequestRecord> records = {
        record(0.25, 1.25, 5, {0.25, 0.25, 0.25, 0.25}, 8),
        record(0.5, 1.5, 3, {0.5, 0.5}, 16),
        record(0.125, 0.125, 1, {}, 8),
    };
    bench::RequestRecord failed;
    failed.error = "HTTP 500";
    records.push_back(failed);
    CHECK(bench::time_per_output_token(records[0]) == 0.25);
    CHECK(bench::time_per_output_token(records[1]) == 0.5);
    CHECK(bench::time_per_output_token(records[2]) == 0.0);

    bench::Metrics m = bench::compute_metrics(records, 2.0);
    CHECK(m.completed == 3);
    CHECK(m.failed == 1);
    CHECK(m.total_input_tokens == 32);
    CHECK(m.total_output_tokens == 9);
    CHECK(m.request_throughput == 1.5);
    CHECK(m.output_throughput == 4.5);
    CHECK(m.total_token_throughput == 20.5);
    CHECK(m.request_goodput == 1.5);  // no SLO: every completed request is good
    CHECK(m.ttft_ms.mean == doctest::Approx(1e3 * 0.875 / 3).epsilon(1e-14));
    CHECK(m.ttft_ms.median == 250.0);
    CHECK(m.tpot_ms.count == 2);  // the one-token request has no TPOT
    CHECK(m.tpot_ms.mean == 375.0);
    CHECK(m.tpot_ms.median == 375.0);
    CHECK(m.itl_ms.count == 6);   // every gap of every request, pooled
    CHECK(m.itl_ms.mean == doctest::Approx(1e3 * 2.0 / 6).epsilon(1e-14));
    CHECK(m.itl_ms.median == 250.0);
    CHECK(m.itl_ms.p99 == 500.0);
    CHECK(m.e2el_ms.mean == doctest::Approx(1e3 * 2.875 / 3).epsilon(1e-14));
    CHECK(m.e2el_ms.p90 == doctest::Approx(1450.0).epsilon(1e-12));  // sorted 125, 1250, 1500: rank 1.8
}

TEST_CASE("goodput counts the requests within every SLO given") {
    std::vector<bench::RequestRecord> records = {
        record(0.25, 1.25, 5),  // TTFT 250 ms, TPOT 250 ms, E2E 1250 ms
        record(0.5, 1.5, 3),    // TTFT 500 ms, TPOT 500 ms, E2E 1500 ms
        record(0.125, 0.125, 1),// TPOT 0 (one token), E2E 125 ms
    };
    auto good = [&](const std::string& slo) { return bench::compute_metrics(records, 4.0, bench::parse_slo(slo)).good; };
    CHECK(good("ttft:250") == 2);               // ≤: 250 ms meets a 250 ms SLO, as vLLM's `slo >= value`
    CHECK(good("ttft:249.9") == 1);
    CHECK(good("tpot:300") == 2);               // the one-token request's TPOT is 0
    CHECK(good("ttft:1000,tpot:300,e2e:1000") == 1);
    CHECK(good("e2el:1500") == 3);              // vLLM's spelling of e2e
    CHECK(good("ttft:500 tpot:500") == 3);      // vLLM's space-separated form
    CHECK(bench::compute_metrics(records, 4.0, bench::parse_slo("ttft:250")).request_goodput == 0.5);
}

namespace {

// A sweep point as a run would report it: `completed` of `completed + failed` requests over `duration` seconds,
// `good` of them within the SLO, median TTFT and E2E as given.
bench::SweepPoint point(double rate, int completed, int good, double duration, double ttft_ms = 10, double e2e_ms = 100,
                        int failed = 0) {
    bench::SweepPoint p{rate, {}};
    p.metrics.completed = completed;
    p.metrics.failed = failed;
    p.metrics.good = good;
    p.metrics.duration = duration;
    p.metrics.request_throughput = completed / duration;
    p.metrics.ttft_ms.median = ttft_ms;
    p.metrics.e2el_ms.median = e2e_ms;
    return p;
}

}  // namespace

TEST_CASE("the knee of a sweep is the last rate before goodput or latency bends") {
    // With an SLO: a rate is met when ≥ 90% of its requests are good. Given out of order; 8 misses (7/10), so the
    // knee is 4, the last rate before it (index 0 in the order given); 16 passes again but comes after the bend.
    std::vector<bench::SweepPoint> sweep = {point(4, 10, 10, 5), point(1, 10, 10, 20), point(2, 10, 9, 10),
                                            point(8, 10, 7, 3), point(16, 10, 10, 2)};
    bench::Knee knee = bench::find_knee(sweep, true);
    CHECK(knee.index == 0);
    CHECK(knee.bend == 3);
    CHECK(knee.why == "7 of 10 requests met the SLO, under 90%");
    CHECK(bench::knee_text(sweep, knee, "the criterion") ==
          "knee: 4 requests/s (the last rate before 8 requests/s, where 7 of 10 requests met the SLO, under 90%)");

    sweep[1].metrics.good = 8;  // the lowest rate misses: no knee
    knee = bench::find_knee(sweep, true);
    CHECK(knee.index == -1);
    CHECK(knee.bend == 1);
    CHECK(bench::knee_text(sweep, knee, "the criterion") == "knee: none (even the lowest rate misses: the criterion)");

    // Without an SLO: met when the server keeps up (completed/s ≥ 90% of the rate offered, none failed).
    std::vector<bench::SweepPoint> keep_up = {point(1, 10, 10, 10), point(2, 10, 10, 5.5), point(4, 10, 10, 4)};
    knee = bench::find_knee(keep_up, false);
    CHECK(knee.index == 1);  // 10/5.5 = 1.82 ≥ 1.8; at 4/s only 2.5/s completed
    CHECK(knee.bend == 2);
    CHECK(knee.why == "it completed 2.50 req/s, under 90% of the rate offered");
    keep_up[2] = point(4, 9, 9, 2.5, 10, 100, 1);  // 3.6/s completed, but one request failed
    CHECK(bench::find_knee(keep_up, false).why == "1 of 10 requests failed");
}

TEST_CASE("the knee: a latency that doubles bends the sweep even when every rate is met") {
    // Every rate keeps up and meets the SLO, but at 8/s the median TTFT goes from 12 to 30 ms (2.5×): a queue is
    // building. The knee is 4/s. A rise under 2× (10 → 12 ms) is not a bend.
    std::vector<bench::SweepPoint> sweep = {point(2, 10, 10, 5, 10, 100), point(4, 10, 10, 2.5, 12, 110),
                                            point(8, 10, 10, 1.25, 30, 150), point(16, 10, 10, 0.625, 300, 900)};
    bench::Knee knee = bench::find_knee(sweep, true);
    CHECK(knee.index == 1);
    CHECK(knee.bend == 2);
    CHECK(knee.why == "the median TTFT rose 2.5x, from 12.00 to 30.00 ms");
    // The median E2E alone is enough: exactly 2× the lower rate's counts.
    sweep[2].metrics.ttft_ms.median = 12;
    sweep[2].metrics.e2el_ms.median = 220;
    knee = bench::find_knee(sweep, false);
    CHECK(knee.index == 1);
    CHECK(knee.why == "the median E2E rose 2.0x, from 110.00 to 220.00 ms");
}

TEST_CASE("the knee: a sweep that never bends has none, and the report says to raise the rate") {
    const double inf = std::numeric_limits<double>::infinity();
    // Every rate kept up, latencies flat: the highest rate tested is a lower bound on the knee, not the knee.
    std::vector<bench::SweepPoint> sweep = {point(1, 10, 10, 10, 10, 100), point(2, 10, 10, 5, 11, 105),
                                            point(4, 10, 10, 2.5, 12, 110), point(8, 10, 10, 1.25, 19, 190)};
    bench::Knee knee = bench::find_knee(sweep, false);
    CHECK(knee.index == -1);
    CHECK(knee.bend == -1);
    const std::string criterion = bench::knee_criterion({});
    CHECK(criterion == "completed req/s >= 90% of the offered rate, no failures");
    const std::string line = bench::knee_text(sweep, knee, criterion);
    CHECK(line.rfind("knee: no knee up to 8 requests/s: raise --rate (", 0) == 0);
    CHECK(line.find("knee: 8") == std::string::npos);
    CHECK(bench::find_knee(sweep, true).index == -1);  // the same with an SLO every request met

    // With inf (all at once) in the sweep and met too, there is no higher rate to ask for.
    sweep.push_back(point(inf, 10, 10, 1, 20, 200));
    knee = bench::find_knee(sweep, false);
    CHECK(knee.index == -1);
    CHECK(knee.bend == -1);
    CHECK(bench::knee_text(sweep, knee, criterion).rfind("knee: no knee up to inf requests/s (all at once): ", 0) == 0);
    // All at once doubles the median TTFT: the knee is the highest finite rate.
    sweep.back().metrics.ttft_ms.median = 40;
    knee = bench::find_knee(sweep, false);
    CHECK(knee.index == 3);
    CHECK(knee.bend == 4);
    CHECK(bench::knee_text(sweep, knee, criterion).rfind("knee: 8 requests/s (the last rate before inf requests/s, ", 0) == 0);
}

TEST_CASE("--slo and --rate errors name the option and the value") {
    CHECK(test::error_of([] { bench::parse_slo("ttft"); }).find("\"ttft\" is not NAME:MILLISECONDS") != std::string::npos);
    CHECK(test::error_of([] { bench::parse_slo("ttft:fast"); }).find("\"fast\" is not a number of milliseconds") != std::string::npos);
    CHECK(test::error_of([] { bench::parse_slo("latency:5"); }).find("unknown metric \"latency\"") != std::string::npos);
    CHECK(test::error_of([] { bench::parse_slo("tpot:-5"); }).find("positive") != std::string::npos);
    CHECK(test::error_of([] { bench::parse_slo(""); }).find("--slo") != std::string::npos);
    bench::Slo slo = bench::parse_slo("ttft:500,tpot:50,e2e:2000");
    CHECK(*slo.ttft_ms == 500);
    CHECK(*slo.tpot_ms == 50);
    CHECK(*slo.e2e_ms == 2000);

    CHECK(bench::parse_rates("1,2,4.5") == std::vector<double>{1, 2, 4.5});
    CHECK(std::isinf(bench::parse_rates("inf")[0]));
    CHECK(test::error_of([] { bench::parse_rates("fast"); }).find("option --rate: \"fast\" is not a request rate") != std::string::npos);
    CHECK(test::error_of([] { bench::parse_rates("0"); }).find("must be positive") != std::string::npos);
    CHECK(test::error_of([] { bench::parse_rates("1,,2"); }).find("option --rate") != std::string::npos);
}

TEST_CASE("arrivals: inf sends at once, a seed repeats, burstiness keeps the mean gap") {
    std::vector<double> now = bench::arrival_times(5, std::numeric_limits<double>::infinity(), 1.0, 0);
    CHECK(now == std::vector<double>(5, 0.0));
    std::vector<double> a = bench::arrival_times(2000, 4.0, 1.0, 7), b = bench::arrival_times(2000, 4.0, 1.0, 7);
    CHECK(a == b);
    CHECK(a[0] == 0.0);
    CHECK(std::is_sorted(a.begin(), a.end()));
    // The gamma's mean is shape·scale = burstiness · 1/(rate·burstiness) = 1/rate: 1999 gaps average near 0.25 s.
    CHECK(a.back() / 1999 == doctest::Approx(0.25).epsilon(0.1));
    std::vector<double> bursty = bench::arrival_times(2000, 4.0, 0.25, 7);
    CHECK(bursty.back() / 1999 == doctest::Approx(0.25).epsilon(0.2));
    CHECK(test::error_of([] { bench::arrival_times(3, 1.0, 0.0, 0); }).find("--burstiness") != std::string::npos);
}

TEST_CASE("datasets: random lengths in range, shared prefixes shared, JSONL read") {
    std::vector<bench::Prompt> prompts = bench::random_dataset(200, 100, 50, 0.5, 512, 1);
    for (const bench::Prompt& p : prompts) {
        CHECK(p.prompt_tokens >= 50);
        CHECK(p.prompt_tokens <= 150);
        CHECK(p.output_tokens >= 25);
        CHECK(p.output_tokens <= 75);
        CHECK(static_cast<int>(p.ids.size()) == p.prompt_tokens);
        for (int id : p.ids) CHECK((id >= 3 && id < 512));
    }
    CHECK(bench::random_dataset(3, 16, 4, 0.0, 512, 1)[0].ids.size() == 16);
    CHECK(test::error_of([] { bench::random_dataset(3, 16, 4, 1.0, 512, 1); }).find("--range-ratio") != std::string::npos);

    std::vector<bench::Prompt> shared = bench::shared_prefix_dataset(8, 2, 32, 8, 4, 512, 3);
    for (int i = 0; i < 8; ++i) {
        CHECK(shared[i].ids.size() == 40);
        CHECK(std::equal(shared[i].ids.begin(), shared[i].ids.begin() + 32, shared[i % 2].ids.begin()));
    }
    CHECK(!std::equal(shared[0].ids.begin(), shared[0].ids.begin() + 32, shared[1].ids.begin()));

    test::TempDir dir("bench-jsonl");
    test::write_file(dir / "p.jsonl", "{\"prompt\": \"Once upon\", \"output_len\": 7}\n\n{\"prompt\": \"a time\"}\n");
    std::vector<bench::Prompt> file = bench::jsonl_dataset((dir / "p.jsonl").string(), 3, 5);
    REQUIRE(file.size() == 3);
    CHECK(file[0].text == "Once upon");
    CHECK(file[0].output_tokens == 7);
    CHECK(file[1].output_tokens == 5);
    CHECK(file[2].text == "Once upon");  // cycled
    test::write_file(dir / "bad.jsonl", "{\"prompt\": 5}\n");
    CHECK(test::error_of([&] { bench::jsonl_dataset((dir / "bad.jsonl").string(), 1, 5); }).find("line 1: no \"prompt\" string") != std::string::npos);
}

TEST_CASE("the layers are the server's, in the order a request meets them") {
    // `infer serve` sends these as "<layer>_ms" in infer_timing (tools/server.hpp, timing_layers); route is the
    // router's choice, step_wait the wait for the engine's current step to end before the engine takes the request.
    const std::vector<std::string> expected = {"http_parse", "tokenize", "route", "step_wait", "queue", "schedule",
                                               "prefill", "decode", "sample", "detokenize", "http_write", "other"};
    REQUIRE(bench::layer_count == expected.size());
    for (size_t i = 0; i < expected.size(); ++i) {
        CHECK(bench::layer_names[i] == expected[i]);
        CHECK(bench::layer_index(expected[i]) == i);
    }
    CHECK(bench::layer_index("no such layer") == bench::layer_count);
    for (const char* before : {"http_parse", "tokenize", "route", "step_wait", "queue", "prefill"})
        CHECK(bench::layer_before_first_token[bench::layer_index(before)]);
    for (const char* after : {"schedule", "decode", "sample", "detokenize", "http_write", "other"})
        CHECK(!bench::layer_before_first_token[bench::layer_index(after)]);
}

TEST_CASE("the layer breakdown sums the server's timings and names the dominant layer") {
    const size_t tokenize = bench::layer_index("tokenize"), step_wait = bench::layer_index("step_wait"),
                 queue = bench::layer_index("queue"), prefill = bench::layer_index("prefill"),
                 decode = bench::layer_index("decode");
    std::vector<bench::RequestRecord> records = {record(0.1, 1.0, 10), record(0.1, 1.0, 10)};
    for (bench::RequestRecord& r : records) {
        bench::LayerTiming t;
        t.ms[tokenize] = 10;
        t.ms[step_wait] = 5;
        t.ms[queue] = 60;
        t.ms[prefill] = 20;
        t.ms[decode] = 900;
        t.e2e_ms = 995;
        r.timing = t;
    }
    bench::Breakdown b = bench::compute_breakdown(records);
    CHECK(b.requests == 2);
    CHECK(b.mean_e2e_ms == 1000.0);
    REQUIRE(b.rows.size() == bench::layer_count + 1);
    CHECK(b.rows[queue].layer == "queue");
    CHECK(b.rows[step_wait].layer == "step_wait");
    // TTFT 100 ms: tokenize 10 + step_wait 5 + prefill 20 leave 65 ms, of which the queue's 60 ms are all before the
    // first token; the 5 ms left are the client's and the network's.
    CHECK(b.rows[queue].share_of_ttft == doctest::Approx(0.6).epsilon(1e-12));
    CHECK(b.rows[step_wait].share_of_ttft == doctest::Approx(0.05).epsilon(1e-12));
    CHECK(b.rows[step_wait].share_of_e2e == doctest::Approx(0.005).epsilon(1e-12));
    CHECK(b.rows.back().share_of_ttft == doctest::Approx(0.05).epsilon(1e-12));
    CHECK(b.rows[decode].share_of_e2e == doctest::Approx(0.9).epsilon(1e-12));
    CHECK(b.rows[decode].share_of_ttft == -1);  // decode is not part of TTFT
    CHECK(b.rows.back().layer == "client+network");
    CHECK(b.rows.back().share_of_e2e == doctest::Approx(0.005).epsilon(1e-9));
    CHECK(b.dominant_ttft == "queue");
    CHECK(b.dominant_e2e == "decode");
    CHECK(b.hint.find("instances") != std::string::npos);
    CHECK(b.hint.find("memory-bandwidth") != std::string::npos);
    CHECK(b.worst_sum_error == doctest::Approx(0.005).epsilon(1e-9));

    // A queue longer than the TTFT leaves (waits between later steps) counts in TTFT only up to what TTFT leaves.
    records[0].timing->ms[queue] = records[1].timing->ms[queue] = 500;
    b = bench::compute_breakdown(records);
    CHECK(b.rows[queue].share_of_ttft == doctest::Approx(0.65).epsilon(1e-12));
    CHECK(b.rows.back().share_of_ttft == doctest::Approx(0.0).epsilon(1e-12));
    CHECK(b.dominant_ttft == "queue");

    // Long engine steps: the wait for the current step to end dominates TTFT, and the hint names the step size.
    for (bench::RequestRecord& r : records) r.timing->ms[queue] = 0, r.timing->ms[step_wait] = 60;
    b = bench::compute_breakdown(records);
    CHECK(b.rows[step_wait].share_of_ttft == doctest::Approx(0.6).epsilon(1e-12));
    CHECK(b.dominant_ttft == "step_wait");
    CHECK(b.hint.find("TTFT: step_wait — waiting for the engine's current step") != std::string::npos);
    CHECK(b.hint.find("--max-batch-tokens") != std::string::npos);
}

TEST_CASE("SVG charts are well-formed text") {
    bench::Chart chart = bench::latency_cdf_chart({record(0.25, 1.25, 5, {0.25, 0.5})}, "a <title>");
    std::ostringstream out;
    bench::write_svg(out, chart);
    std::string svg = out.str();
    CHECK(svg.rfind("<svg xmlns=\"http://www.w3.org/2000/svg\"", 0) == 0);
    CHECK(svg.find("a &lt;title&gt;") != std::string::npos);
    CHECK(svg.find("<polyline") != std::string::npos);
    CHECK(svg.find("</svg>") != std::string::npos);
    CHECK(svg.find("nan") == std::string::npos);
    CHECK(svg.find("inf") == std::string::npos);
}

namespace {

// The characters of an SVG text's content: an entity (&lt;) is one, and so is a UTF-8 sequence (×).
size_t characters(const std::string& content) {
    size_t count = 0;
    for (size_t i = 0; i < content.size(); ++i) {
        if (content[i] == '&') i = content.find(';', i);
        if ((static_cast<unsigned char>(content[i]) & 0xC0) != 0x80) ++count;
    }
    return count;
}

double svg_width(const std::string& svg) {
    std::smatch match;
    REQUIRE(std::regex_search(svg, match, std::regex(R"re(<svg [^>]*width="([0-9.]+)")re")));
    return std::stod(match[1]);
}

// Every text drawn from its x rightwards (no text-anchor: the legend, point labels), as {x, content}.
std::vector<std::pair<double, std::string>> left_anchored_texts(const std::string& svg) {
    std::vector<std::pair<double, std::string>> texts;
    const std::regex text(R"re(<text x="([0-9.-]+)" y="[0-9.-]+"(?: font-size="[0-9]+")?>([^<]*)</text>)re");
    for (auto it = std::sregex_iterator(svg.begin(), svg.end(), text); it != std::sregex_iterator(); ++it)
        texts.push_back({std::stod((*it)[1]), (*it)[2]});
    return texts;
}

}  // namespace

TEST_CASE("the throughput chart of a sweep draws the all-at-once rate at the right end, under an inf tick") {
    const double inf = std::numeric_limits<double>::infinity();
    std::vector<bench::SweepPoint> sweep = {point(2, 10, 10, 5), point(inf, 10, 10, 1), point(1, 10, 10, 10), point(4, 10, 10, 2.5)};
    for (bench::SweepPoint& p : sweep) {
        p.metrics.output_throughput = std::isinf(p.rate) ? 900 : 100 * p.rate;
        p.metrics.total_token_throughput = 2 * p.metrics.output_throughput;
    }
    std::ostringstream out;
    bench::write_svg(out, bench::throughput_chart(sweep));
    const std::string svg = out.str();
    INFO(svg);
    CHECK(svg.find("nan") == std::string::npos);

    std::smatch tick;
    REQUIRE(std::regex_search(svg, tick, std::regex(R"re(<text x="([0-9.]+)" y="[0-9.]+" text-anchor="middle">inf</text>)re")));
    const double inf_x = std::stod(tick[1]);
    std::vector<double> circles;
    const std::regex circle(R"re(<circle cx="([0-9.]+)")re");
    for (auto it = std::sregex_iterator(svg.begin(), svg.end(), circle); it != std::sregex_iterator(); ++it)
        circles.push_back(std::stod((*it)[1]));
    REQUIRE(circles.size() == 8);  // four rates, inf among them, in each of the two series
    CHECK(std::count(circles.begin(), circles.end(), inf_x) == 2);  // the inf point of each series, on its tick
    for (double x : circles) CHECK(x <= inf_x);
    std::smatch four;
    REQUIRE(std::regex_search(svg, four, std::regex(R"re(<text x="([0-9.]+)" y="[0-9.]+" text-anchor="middle">4</text>)re")));
    CHECK(std::stod(four[1]) < inf_x);  // past the largest finite rate
    CHECK(inf_x < svg_width(svg));
}

TEST_CASE("chart legends fit inside the SVG's width") {
    bench::Roofline roof;
    roof.bandwidth = 10e9, roof.peak = 100e9, roof.threads = 2;
    roof.points = {{"prefill", 1, 256, 0.01, {5e9, 4e8, 1e6}}, {"decode", 4, 4, 0.001, {1e8, 4e8, 1e6}}};
    bench::Chart long_names = bench::latency_cdf_chart({record(0.25, 1.25, 5, {0.25, 0.5})}, "CDFs");
    long_names.series[0].name = "a series whose name runs well past the default 180 px margin <&> ×";
    for (const bench::Chart& chart : {bench::roofline_chart(roof, "roofline"), long_names,
                                      bench::step_timeline_chart({}, "steps")}) {
        std::ostringstream out;
        bench::write_svg(out, chart);
        const std::string svg = out.str();
        const double width = svg_width(svg);
        size_t legend_texts = 0;
        for (const auto& [x, content] : left_anchored_texts(svg)) {
            INFO(content << " at x " << x << " in an SVG " << width << " wide");
            CHECK(x + 7 * static_cast<double>(characters(content)) <= width);
            for (const bench::Series& s : chart.series) legend_texts += content == bench::svg_escape(s.name);
            for (const auto& [name, color] : chart.legend_rects) legend_texts += content == bench::svg_escape(name);
        }
        CHECK(legend_texts == chart.series.size() + chart.legend_rects.size());  // the check saw every legend entry
    }
}

TEST_CASE("bench engine and the roofline run on a small model") {
    REQUIRE_SHARED_OR_SKIP();
    infer::Model model = infer::load_model(test::shared_dir() / "models" / "stories260K" / "stories260K.gguf");
    infer::ThreadPool pool(1);
    bench::EngineRun run = bench::run_engine(model, pool, 3, 8, 5);
    REQUIRE(run.records.size() == 3);
    for (const bench::RequestRecord& r : run.records) {
        CHECK(r.output_tokens == 5);
        CHECK(r.prompt_tokens == 8);
        CHECK(r.itl.size() == 4);
        CHECK(r.ttft <= r.latency);
    }
    // A 16-bit KV cache (the type llama.cpp's benchmarks keep) runs the same requests to the same lengths.
    bench::EngineRun half = bench::run_engine(model, pool, 2, 8, 3, 0, 512, {}, infer::DType::F16);
    REQUIRE(half.records.size() == 2);
    for (const bench::RequestRecord& r : half.records) CHECK(r.output_tokens == 3);
    const std::string stories = (test::shared_dir() / "models" / "stories260K" / "stories260K.gguf").string();
    test::ProgramRun cli = test::run_infer({"bench", "engine", "-m", stories, "--batch", "2", "--input-len", "4",
                                            "--output-len", "3", "-t", "1", "--cache-type", "bf16"});
    CHECK(cli.exit_code == 0);
    CHECK(cli.out.find("KV cache BF16") != std::string::npos);
    // --no-mmap reads the weights into memory: the same table, from the same model.
    cli = test::run_infer({"bench", "engine", "-m", stories, "--batch", "2", "--input-len", "4", "--output-len", "3",
                           "-t", "1", "--no-mmap"});
    CHECK(cli.exit_code == 0);
    CHECK(cli.out.find("|     2 |     4 |      3 |") != std::string::npos);
    cli = test::run_infer({"bench", "roofline", "-m", stories, "--prefill", "4", "--decode-batch", "1", "--repeats", "1",
                           "--bandwidth-mib", "16", "-t", "1", "--no-mmap"});
    CHECK(cli.exit_code == 0);
    CHECK(cli.out.find("| prefill |    1 |      4 |") != std::string::npos);
    CHECK(cli.out.find("| decode  |    1 |      1 |") != std::string::npos);
    cli = test::run_infer({"bench", "engine", "-m", stories, "--cache-type", "q4"});
    CHECK(cli.exit_code == 1);
    CHECK(cli.err.find("--cache-type") != std::string::npos);
    // The cost model: one decode token of a 260K-parameter model is 2 FLOPs per matrix weight plus attention.
    bench::ForwardCost cost = bench::forward_cost(model, {0}, 1, 1);
    const infer::ModelConfig& c = model.config;
    double per_layer = 0;
    for (const infer::Tensor* t : {&model.layers[0].wq, &model.layers[0].wk, &model.layers[0].wv, &model.layers[0].wo,
                                   &model.layers[0].w_gate, &model.layers[0].w_up, &model.layers[0].w_down})
        per_layer += static_cast<double>(t->elements());
    CHECK(cost.kv_bytes == 2.0 * 4 * c.n_layers * c.n_kv_heads * c.head_dim);  // one token's K and V, f32
    CHECK(cost.flops == 2 * per_layer * c.n_layers + 2.0 * c.vocab_size * c.dim + 4.0 * c.n_layers * c.n_heads * c.head_dim);
    bench::RooflinePoint decode = bench::time_forward(model, pool, "decode", 4, 1, 8, 1);
    CHECK(decode.tokens == 4);
    CHECK(decode.seconds > 0);
}

TEST_CASE("infer bench: errors name the option") {
    test::ProgramRun run = test::run_infer({"bench", "serve", "--url", "http://127.0.0.1:9", "--slo", "ttft=5"});
    CHECK(run.exit_code == 1);
    CHECK(run.err.find("option --slo: \"ttft=5\" is not NAME:MILLISECONDS") != std::string::npos);
    run = test::run_infer({"bench", "serve", "--url", "http://127.0.0.1:9", "--rate", "lots"});
    CHECK(run.exit_code == 1);
    CHECK(run.err.find("option --rate: \"lots\" is not a request rate") != std::string::npos);
    run = test::run_infer({"bench", "serve", "--url", "http://127.0.0.1:9", "--rate", "1,-2"});
    CHECK(run.err.find("option --rate: -2 must be positive") != std::string::npos);
    run = test::run_infer({"bench", "serve", "--rate", "1"});
    CHECK(run.err.find("needs --url") != std::string::npos);
    run = test::run_infer({"bench", "serve", "--url", "127.0.0.1:8000"});
    CHECK(run.err.find("is not an http:// URL") != std::string::npos);
    run = test::run_infer({"bench", "serve", "--url", "http://127.0.0.1:9", "--dataset", "sharegpt"});
    CHECK(run.err.find("unknown dataset \"sharegpt\"") != std::string::npos);
    run = test::run_infer({"bench", "serve", "--url", "http://127.0.0.1:9", "--burstiness", "0"});
    CHECK(run.err.find("--burstiness") != std::string::npos);
    run = test::run_infer({"bench", "engine", "--batch", "1,x"});
    CHECK(run.err.find("needs -m PATH") != std::string::npos);
    run = test::run_infer({"bench", "frobnicate"});
    CHECK(run.exit_code == 1);
    CHECK(run.err.find("unknown bench \"frobnicate\"") != std::string::npos);
}

#ifdef INFER_BENCH_HTTP

namespace {

// A deterministic OpenAI streaming server: each completion streams max_tokens one-character chunks, then a chunk
// with the finish_reason, then a usage chunk carrying infer_timing, then [DONE]. It checks the request asks for what
// vLLM's benchmark asks for, and counts the requests. Its infer_timing has no step_wait_ms, as a server from before
// that layer sends it: the bench must read the layer as 0.
class FakeServer {
public:
    FakeServer() {
        server_.Get("/v1/models", [](const httplib::Request&, httplib::Response& res) {
            res.set_content(R"({"object":"list","data":[{"id":"fake-model","object":"model"}]})", "application/json");
        });
        server_.Post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) {
            nlohmann::json body = nlohmann::json::parse(req.body);
            ++requests_;
            if (body.value("model", "") != "fake-model" || !body.value("stream", false) || !body.value("ignore_eos", false) ||
                !body["stream_options"].value("include_usage", false) || !body["prompt"].is_array()) {
                ++malformed_;
                res.status = 400;
                res.set_content(R"({"error":{"message":"bad request"}})", "application/json");
                return;
            }
            const int max_tokens = body["max_tokens"].get<int>(), prompt = static_cast<int>(body["prompt"].size());
            res.set_chunked_content_provider("text/event-stream", [max_tokens, prompt](size_t, httplib::DataSink& sink) {
                auto send = [&](const std::string& json) {
                    std::string event = "data: " + json + "\n\n";
                    sink.write(event.data(), event.size());
                };
                for (int i = 0; i < max_tokens; ++i)
                    send(R"({"object":"text_completion","choices":[{"index":0,"text":"x","finish_reason":null}],"usage":null})");
                send(R"({"object":"text_completion","choices":[{"index":0,"text":"","finish_reason":"length"}],"usage":null})");
                send(R"({"object":"text_completion","choices":[],"usage":{"prompt_tokens":)" + std::to_string(prompt) +
                     R"(,"completion_tokens":)" + std::to_string(max_tokens) +
                     R"(},"infer_timing":{"http_parse_ms":0.1,"tokenize_ms":0,"route_ms":0,"queue_ms":0.5,"schedule_ms":0.1,)"
                     R"("prefill_ms":1,"decode_ms":3,"sample_ms":0.1,"detokenize_ms":0.1,"http_write_ms":0.1,"other_ms":0,"e2e_ms":5}})");
                send("[DONE]");
                sink.done();
                return true;
            });
        });
        port_ = server_.bind_to_any_port("127.0.0.1");
        thread_ = std::thread([this] { server_.listen_after_bind(); });
        while (!server_.is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    ~FakeServer() {
        server_.stop();
        thread_.join();
    }
    std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }
    int requests() const { return requests_; }
    int malformed() const { return malformed_; }

private:
    httplib::Server server_;
    int port_ = 0;
    std::thread thread_;
    std::atomic<int> requests_{0}, malformed_{0};
};

}  // namespace

TEST_CASE("infer bench serve against a fake server: a complete JSON report, CDFs, the knee") {
    FakeServer server;
    test::TempDir dir("bench-serve");
    test::ProgramRun run = test::run_infer({"bench", "serve", "--url", server.url(), "--num-prompts", "6", "--input-len", "12",
                                            "--output-len", "4", "--rate", "200,inf", "--concurrency", "3", "--warmup", "1",
                                            "--slo", "ttft:60000,tpot:60000", "--json", (dir / "r.json").string(),
                                            "--svg", (dir / "svg").string(), "--no-progress"});
    INFO(run.err);
    REQUIRE(run.exit_code == 0);
    CHECK(server.malformed() == 0);
    CHECK(server.requests() == 13);  // one warm-up, then six per rate
    CHECK(run.out.find("Serving Benchmark Result") != std::string::npos);
    // Every request meets the SLO at both rates, so whether the sweep bends depends only on whether all at once
    // doubles a median latency, which is the machine's business; the report must agree with itself either way.
    CHECK(run.out.find("knee: inf requests/s") == std::string::npos);  // inf is never the knee: nothing lies above it

    nlohmann::json report = nlohmann::json::parse(infer::read_text_file(dir / "r.json"));
    CHECK(report["config"]["model"] == "fake-model");
    REQUIRE(report["runs"].size() == 2);
    for (const nlohmann::json& r : report["runs"]) {
        CHECK(r["completed"] == 6);
        CHECK(r["failed"] == 0);
        CHECK(r["total_input_tokens"] == 72);
        CHECK(r["total_output_tokens"] == 24);
        CHECK(r["max_concurrency"] == 3);
        for (const char* key : {"duration", "request_throughput", "request_goodput", "output_throughput", "total_token_throughput"})
            CHECK(r[key].is_number());
        for (const char* metric : {"ttft", "tpot", "itl", "e2el"})
            for (const char* stat : {"mean", "median", "std", "p90", "p99"})
                CHECK(r[std::string(stat) + "_" + metric + "_ms"].is_number());
        REQUIRE(r["requests"].size() == 6);
        for (const nlohmann::json& q : r["requests"]) {
            CHECK(q["success"] == true);
            CHECK(q["output_len"] == 4);
            CHECK(q["itl_ms"].size() == 3);  // 4 token chunks; the empty finish chunk adds no gap
            CHECK(q["infer_timing"]["decode_ms"] == 3.0);
            CHECK(q["infer_timing"]["step_wait_ms"] == 0.0);  // not sent: counts 0
        }
        CHECK(r["breakdown"]["requests"] == 6);
        CHECK(r["breakdown"]["layers"].size() == bench::layer_count + 1);
        CHECK(r["breakdown"]["dominant_e2e"].is_string());
    }
    CHECK(report["runs"][1]["request_rate"] == "inf");
    if (report["knee"]["rate"].is_null()) {
        CHECK(run.out.find("knee: no knee up to inf requests/s (all at once): every rate met") != std::string::npos);
    } else {
        CHECK(report["knee"]["rate"] == 200.0);
        CHECK(run.out.find("knee: 200 requests/s (the last rate before inf requests/s, where the median") != std::string::npos);
    }
    CHECK(report["knee"]["criterion"].get<std::string>().find("60000") != std::string::npos);
    CHECK(std::filesystem::exists(dir / "svg" / "latency_cdf_rate_inf.svg"));
    CHECK(std::filesystem::exists(dir / "svg" / "latency_cdf_rate_200.svg"));
    CHECK(std::filesystem::exists(dir / "svg" / "throughput_vs_rate.svg"));
}

TEST_CASE("infer bench serve: a server that is not there is a clear failure") {
    int port = 0;
    {
        FakeServer gone;
        port = std::stoi(gone.url().substr(gone.url().rfind(':') + 1));
    }
    test::ProgramRun run = test::run_infer({"bench", "serve", "--url", "http://127.0.0.1:" + std::to_string(port), "--model", "m",
                                            "--num-prompts", "2", "--no-progress"});
    CHECK(run.exit_code == 1);
    CHECK(run.err.find("no request completed; the first error: HTTP: ") != std::string::npos);
}

namespace {

using client::free_port;

using ServeProcess = serve_test::Process;  // `infer serve` as a child process, its stderr kept
using serve_test::wait_for_health;

}  // namespace

TEST_CASE("infer bench serve against a real infer serve: a complete report, each breakdown sums to its e2e") {
    // Every check here holds whatever the machine's speed: no figure is compared with a time budget.
    REQUIRE_SHARED_OR_SKIP();
    const std::string model = (test::shared_dir() / "models" / "stories260K" / "stories260K.gguf").string();
    const int port = free_port();
    ServeProcess server({std::getenv("INFER_BIN"), "serve", "-m", model, "--port", std::to_string(port), "-t", "1"}, "bench-serve");
    REQUIRE_MESSAGE(wait_for_health(port), "infer serve did not become healthy:\n" << server.log());
    test::TempDir dir("bench-real");
    // Long requests (448 tokens, one at a time, after a warm-up) so that the microseconds outside the server (the
    // client, loopback, the server's accept) are a small part of each, even on a busy machine.
    test::ProgramRun run = test::run_infer({"bench", "serve", "--url", "http://127.0.0.1:" + std::to_string(port), "--warmup", "1",
                                            "--num-prompts", "4", "--concurrency", "1", "--input-len", "32", "--output-len", "448",
                                            "--tokenizer", model, "--json", (dir / "r.json").string(), "--no-progress"});
    INFO(run.err);
    REQUIRE(run.exit_code == 0);
    CHECK(run.out.find("layer breakdown over 4 requests") != std::string::npos);
    nlohmann::json report = nlohmann::json::parse(infer::read_text_file(dir / "r.json"));
    REQUIRE(report["runs"].size() == 1);
    const nlohmann::json& r = report["runs"][0];
    CHECK(r["completed"] == 4);
    CHECK(r["failed"] == 0);
    CHECK(r["total_output_tokens"] == 4 * 448);  // ignore_eos and max_tokens: exactly the output length asked
    for (const char* metric : {"ttft", "tpot", "itl", "e2el"})
        for (const char* stat : {"mean", "median", "std", "p90", "p99"}) CHECK(r[std::string(stat) + "_" + metric + "_ms"].is_number());
    CHECK(r["breakdown"]["requests"] == 4);
    for (const nlohmann::json& q : r["requests"]) {
        REQUIRE(q.contains("infer_timing"));
        double layers = 0;
        for (const char* layer : bench::layer_names) {
            REQUIRE(q["infer_timing"].contains(std::string(layer) + "_ms"));
            layers += q["infer_timing"][std::string(layer) + "_ms"].get<double>();
        }
        // The server measures each request's end-to-end time on its own clock (e2e_ms, from the moment httplib has
        // read the request to the last byte written); its layers must add up to it. Above it means some time was
        // counted in two layers. The client's measurement (sent to last byte read) holds the server's whole window,
        // plus loopback and scheduling: on an idle machine a few tenths of a percent more, on a busy 2-core one
        // several milliseconds, so it is checked to contain the server's time rather than to equal it.
        const double server_e2e = q["infer_timing"]["e2e_ms"].get<double>(), client_e2e = q["done_ms"].get<double>();
        INFO("layers " << layers << " ms, server e2e " << server_e2e << " ms, client e2e " << client_e2e
                       << " ms; infer_timing " << q["infer_timing"].dump());
        CHECK(std::abs(layers - server_e2e) <= 0.05 * server_e2e);
        CHECK(client_e2e >= server_e2e);
        CHECK(q["output_len"] == 448);
        CHECK(q["itl_ms"].size() >= 1);
    }
    CHECK(server.stop() == 0);
}

#endif
