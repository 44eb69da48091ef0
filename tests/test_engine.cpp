// The engine layer: a block manager with prefix caching, the scheduler (continuous batching, chunked prefill,
// preemption) and the Engine's events. The reference for every output is the same request run alone through
// generate_from_ids, whose own tests check it against llama.cpp and llama2.c.
#include "support.hpp"

namespace {

const infer::Model& stories() {
    static infer::Model model = infer::load_model(test::shared_dir() / "models/stories260K/stories260K.gguf");
    return model;
}

// Prompts of many lengths (3 to 70 ids) from a fixed generator: some shorter than a block, some spanning several.
std::vector<std::vector<int>> mixed_prompts(int count, int vocab, uint64_t seed = 7) {
    std::mt19937_64 rng(seed);
    std::vector<std::vector<int>> prompts;
    for (int i = 0; i < count; ++i) {
        std::vector<int> prompt{1};
        int length = 3 + static_cast<int>(rng() % 68);
        while (static_cast<int>(prompt.size()) < length) prompt.push_back(3 + static_cast<int>(rng() % (vocab - 3)));
        prompts.push_back(prompt);
    }
    return prompts;
}

using test::greedy;
using test::seeded;

std::vector<int> alone(infer::ThreadPool& pool, const std::vector<int>& prompt, const infer::SamplingParams& params) {
    return infer::generate_from_ids(stories(), pool, prompt, params).generated_ids;
}

// Every block is back in the pool: none held, the rest free or cached (evictable).
void check_pool_idle(const infer::Engine& engine) {
    const infer::KVCache& cache = engine.cache();
    CHECK(cache.used_block_count() == 0);
    CHECK(cache.free_block_count() + cache.cached_block_count() == cache.num_blocks());
}

infer::EngineConfig config(int max_batch_tokens, int block_size, int max_seqs = 64, int num_blocks = 0) {
    infer::EngineConfig c;
    c.scheduler.max_batch_tokens = max_batch_tokens;
    c.scheduler.max_seqs = max_seqs;
    c.block_size = block_size;
    c.num_blocks = num_blocks;
    return c;
}

}  // namespace

TEST_CASE("block manager: reference counts, prefix hashes, LRU eviction") {
    infer::ModelConfig c = infer::config_for_shape({.dim = 32, .n_layers = 1, .n_heads = 2, .n_kv_heads = 1, .ffn_dim = 64,
                                                    .vocab_size = 100, .context_length = 128});
    infer::KVCache cache(c, 6, 4);
    std::vector<int> a{1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
    CHECK(cache.match_prefix(0, a) == 0);
    REQUIRE(cache.reserve(0, 10));  // 3 blocks
    cache.commit(0, a, 10);         // blocks 0 and 1 are full: named
    CHECK(cache.used_block_count() == 3);
    // The same first eight ids find both named blocks; the last token is left to compute.
    CHECK(cache.match_prefix(1, std::span<const int>(a).first(9)) == 8);
    CHECK(cache.ref_count(cache.block_table(1)[0]) == 2);
    CHECK(cache.block_table(1)[1] == cache.block_table(0)[1]);
    // A prompt of exactly two blocks reuses only the first: its last token must run again for the logits.
    CHECK(cache.match_prefix(2, std::span<const int>(a).first(8)) == 4);
    // The same ids after a different start are a different block.
    std::vector<int> b{9, 2, 3, 4, 5, 6, 7, 8, 1};
    CHECK(cache.match_prefix(3, b) == 0);
    for (int s : {0, 1, 2, 3}) cache.release(s);
    CHECK(cache.used_block_count() == 0);
    CHECK(cache.cached_block_count() == 2);
    CHECK(cache.free_block_count() == 4);
    // Needing every block evicts the cached ones; their names are forgotten.
    REQUIRE(cache.reserve(4, 24));
    CHECK(cache.cached_block_count() == 0);
    CHECK_FALSE(cache.reserve(5, 1));  // running out is a return value
    cache.release(4);
    CHECK(cache.match_prefix(6, a) == 0);
    cache.release(6);
    // With prefix caching off nothing is named or found.
    cache.set_prefix_caching(false);
    REQUIRE(cache.reserve(7, 10));
    cache.commit(7, a, 10);
    cache.release(7);
    CHECK(cache.cached_block_count() == 0);
}

TEST_CASE("requests batched together produce the ids each produces alone") {
    REQUIRE_SHARED_OR_SKIP();
    infer::ThreadPool pool(2);
    const auto prompts = mixed_prompts(7, stories().config.vocab_size);
    for (bool sampled : {false, true}) {
        std::vector<infer::SamplingParams> params;
        std::vector<std::vector<int>> expected;
        for (size_t i = 0; i < prompts.size(); ++i) {
            params.push_back(sampled ? seeded(12 + static_cast<int>(i) * 5, 100 + i) : greedy(12 + static_cast<int>(i) * 5));
            expected.push_back(alone(pool, prompts[i], params.back()));
        }
        // Token budgets from one token per step (every prefill chunked) to all at once, and several block sizes.
        for (const std::tuple<int, int, int>& setting : std::vector<std::tuple<int, int, int>>{{512, 16, 64}, {7, 4, 64}, {64, 8, 3}, {1, 16, 64}, {33, 1, 5}}) {
            int budget, block, max_seqs;  // named variables, not a structured binding: CAPTURE's lambda must see them
            std::tie(budget, block, max_seqs) = setting;
            CAPTURE(sampled);
            CAPTURE(budget);
            CAPTURE(block);
            infer::Engine engine(stories(), pool, config(budget, block, max_seqs));
            std::vector<int> ids;
            for (size_t i = 0; i < prompts.size(); ++i) ids.push_back(engine.add_request(prompts[i], params[i]));
            while (engine.has_work()) engine.step();
            for (size_t i = 0; i < prompts.size(); ++i) {
                auto result = engine.take_result(ids[i]);
                REQUIRE(result);
                CHECK(result->generated_ids == expected[i]);
            }
            check_pool_idle(engine);
            CHECK(engine.totals().decode_tokens > 0);
        }
    }
}

TEST_CASE("the static policy gives the same ids, one batch at a time") {
    REQUIRE_SHARED_OR_SKIP();
    infer::ThreadPool pool(2);
    const auto prompts = mixed_prompts(5, stories().config.vocab_size, 3);
    for (bool touched : {false, true}) {  // a pool written over at the start (KVCache::touch) changes nothing
        CAPTURE(touched);
        infer::EngineConfig c = config(16, 8, 2);
        c.scheduler.policy = infer::SchedulePolicy::Static;
        c.touch_kv_pool = touched;
        infer::Engine engine(stories(), pool, c);
        auto results = engine.generate(prompts, greedy(20));
        for (size_t i = 0; i < prompts.size(); ++i) CHECK(results[i].generated_ids == alone(pool, prompts[i], greedy(20)));
        // Never more than max_seqs sequences in a step.
        for (const infer::StepStats& s : engine.steps()) CHECK(s.sequences <= 2);
        check_pool_idle(engine);
    }
}

TEST_CASE("prefix cache: a repeated prompt hits the cache and gives the same output") {
    REQUIRE_SHARED_OR_SKIP();
    infer::ThreadPool pool(2);
    const std::vector<int> prompt = mixed_prompts(1, stories().config.vocab_size, 11)[0];
    std::vector<int> long_prompt = prompt;
    while (long_prompt.size() < 50) long_prompt.push_back(static_cast<int>(long_prompt.size()) + 10);  // 50 ids
    const auto expected = alone(pool, long_prompt, greedy(20));
    infer::Engine engine(stories(), pool, config(512, 16));

    auto first = engine.generate({long_prompt}, greedy(20))[0];
    CHECK(first.cached_tokens == 0);
    CHECK(first.generated_ids == expected);
    auto second = engine.generate({long_prompt}, greedy(20))[0];
    CHECK(second.cached_tokens == 48);  // three full blocks of 16 of the 50 ids
    CHECK(second.generated_ids == expected);
    CHECK(engine.totals().prefix_hit_tokens == 48);

    // A prompt wholly inside cached blocks (32 ids = two cached blocks): the last token is computed again.
    std::vector<int> cached(long_prompt.begin(), long_prompt.begin() + 32);
    auto third = engine.generate({cached}, greedy(10))[0];
    CHECK(third.cached_tokens == 16);
    CHECK(third.generated_ids == alone(pool, cached, greedy(10)));

    // A follow-up turn: the prompt and its output, then more: the output's blocks were cached too.
    std::vector<int> follow_up = long_prompt;
    follow_up.insert(follow_up.end(), first.generated_ids.begin(), first.generated_ids.end());
    follow_up.push_back(5);
    auto fourth = engine.generate({follow_up}, greedy(10))[0];
    CHECK(fourth.cached_tokens == 64);
    CHECK(fourth.generated_ids == alone(pool, follow_up, greedy(10)));
    check_pool_idle(engine);
    CHECK(engine.cache().cached_block_count() > 0);

    // Requests sharing a prefix in the same step: each computes or shares it, and all stay right.
    infer::Engine together(stories(), pool, config(40, 8));
    std::vector<int> branch = long_prompt;
    branch.push_back(77);
    auto results = together.generate({long_prompt, long_prompt, branch, cached}, greedy(15));
    CHECK(results[0].generated_ids == alone(pool, long_prompt, greedy(15)));
    CHECK(results[1].generated_ids == results[0].generated_ids);
    CHECK(results[2].generated_ids == alone(pool, branch, greedy(15)));
    CHECK(results[3].generated_ids == alone(pool, cached, greedy(15)));
    check_pool_idle(together);

    // With the cache off nothing is found, and nothing stays cached.
    infer::EngineConfig off = config(512, 16);
    off.prefix_caching = false;
    infer::Engine uncached(stories(), pool, off);
    auto again = uncached.generate({long_prompt, long_prompt}, greedy(20));
    CHECK(again[1].cached_tokens == 0);
    CHECK(again[1].generated_ids == expected);
    CHECK(uncached.cache().cached_block_count() == 0);
}

TEST_CASE("a small KV pool forces preemption, and every request still completes with the same ids") {
    REQUIRE_SHARED_OR_SKIP();
    infer::ThreadPool pool(2);
    const auto prompts = mixed_prompts(6, stories().config.vocab_size, 5);
    for (bool prefix_caching : {true, false}) {
        CAPTURE(prefix_caching);
        // Block size 4, 30 blocks: the longest request (70 + 30 ids) needs 25 on its own; together they need ~120.
        infer::EngineConfig c = config(64, 4, 64, 30);
        c.prefix_caching = prefix_caching;
        infer::Engine engine(stories(), pool, c);
        std::vector<int> ids;
        std::vector<infer::SamplingParams> params;
        for (size_t i = 0; i < prompts.size(); ++i) {
            params.push_back(i % 2 ? seeded(30, i) : greedy(30));
            ids.push_back(engine.add_request(prompts[i], params.back()));
        }
        while (engine.has_work()) engine.step();
        CHECK(engine.totals().preemptions > 0);
        int preempted = 0;
        for (size_t i = 0; i < prompts.size(); ++i) {
            auto result = engine.take_result(ids[i]);
            REQUIRE(result);
            CHECK(result->finish_reason == infer::FinishReason::Length);
            CHECK(result->generated_ids == alone(pool, prompts[i], params[i]));
            preempted += result->preemptions;
        }
        CHECK(preempted == engine.totals().preemptions);
        check_pool_idle(engine);
    }
}

TEST_CASE("events: text deltas add up to the result, stop strings are held back and cut") {
    REQUIRE_SHARED_OR_SKIP();
    infer::ThreadPool pool(2);
    infer::Engine engine(stories(), pool, config(512, 16));
    infer::SamplingParams params = greedy(60);
    params.ignore_eos = true;
    auto plain = engine.generate({engine.tokenizer()->encode("Once upon a time")}, params)[0];
    REQUIRE(plain.text.size() > 40);
    CHECK(plain.generated_ids == alone(pool, plain.prompt_ids, params));
    CHECK(plain.text == infer::generate_from_ids(stories(), pool, plain.prompt_ids, params).text);

    // A stop string from the middle of that text: the output ends just before its first occurrence.
    const std::string stop = plain.text.substr(25, 6);
    const size_t cut = plain.text.find(stop);
    int id = engine.add_request("Once upon a time", params, {"never appears", stop});
    std::string streamed;
    std::vector<infer::Event> last;
    while (engine.has_work()) {
        for (const infer::Event& e : engine.step()) {
            CHECK(e.request_id == id);
            streamed += e.text;
            // Nothing streamed ever runs into the stop string, not even its first character.
            CHECK(streamed.size() <= cut);
            if (e.finished) last.push_back(e);
        }
    }
    REQUIRE(last.size() == 1);
    CHECK(last[0].finish_reason == infer::FinishReason::Stop);
    auto result = engine.take_result(id);
    REQUIRE(result);
    CHECK(result->text == plain.text.substr(0, cut));
    CHECK(streamed == result->text);
    CHECK(result->generated_ids.size() < plain.generated_ids.size());
    CHECK(result->times.first_token >= result->times.first_scheduled);
    CHECK(result->times.finished >= result->times.first_token);
    CHECK(result->times.token_times.size() == result->generated_ids.size());
    check_pool_idle(engine);
}

TEST_CASE("cancel frees the request's blocks at the next step") {
    REQUIRE_SHARED_OR_SKIP();
    infer::ThreadPool pool(2);
    infer::EngineConfig c = config(512, 4);
    c.prefix_caching = false;
    infer::Engine engine(stories(), pool, c);
    int a = engine.add_request(mixed_prompts(1, 512, 2)[0], greedy(200));
    int b = engine.add_request(mixed_prompts(1, 512, 3)[0], greedy(5));
    for (int i = 0; i < 3; ++i) engine.step();
    CHECK(engine.cache().used_block_count() > 0);
    engine.cancel(a);
    bool saw_cancel = false;
    while (engine.has_work())
        for (const infer::Event& e : engine.step())
            if (e.request_id == a && e.finished) saw_cancel = e.finish_reason == infer::FinishReason::Cancelled;
    CHECK(saw_cancel);
    CHECK(engine.take_result(a)->finish_reason == infer::FinishReason::Cancelled);
    CHECK(engine.take_result(b)->finish_reason == infer::FinishReason::Length);
    check_pool_idle(engine);
    CHECK(engine.cache().free_block_count() == engine.cache().num_blocks());
    engine.cancel(12345);  // unknown ids are ignored
    CHECK_FALSE(engine.has_work());
}

TEST_CASE("a request that can never fit gets an error event naming the sizes") {
    REQUIRE_SHARED_OR_SKIP();
    infer::ThreadPool pool(2);
    infer::Engine engine(stories(), pool, config(512, 16, 64, 4));  // 64 tokens of KV
    int too_long = engine.add_request(std::vector<int>(2000, 5), greedy(100));
    int too_big = engine.add_request(std::vector<int>(40, 5), greedy(40));
    int empty = engine.add_request(std::vector<int>{}, greedy(4));
    infer::SamplingParams bad = greedy(4);
    bad.top_p = 0;
    int invalid = engine.add_request(std::vector<int>{1, 2}, bad);
    int fine = engine.add_request(std::vector<int>{1, 2, 3}, greedy(4));
    std::map<int, infer::Event> finished;
    while (engine.has_work())
        for (const infer::Event& e : engine.step())
            if (e.finished) finished[e.request_id] = e;
    CHECK(finished[too_long].finish_reason == infer::FinishReason::Error);
    CHECK(finished[too_long].error == "the prompt (2000 tokens) plus max_tokens (100) exceed the model's context of 2048 tokens");
    CHECK(finished[too_big].error == "the prompt (40 tokens) plus max_tokens (40) need 5 KV blocks of 16 tokens, but the whole pool holds 4");
    CHECK(finished[empty].error.find("the prompt is empty") != std::string::npos);
    CHECK(finished[invalid].error.find("top_p") != std::string::npos);
    CHECK(finished[fine].finish_reason == infer::FinishReason::Length);
    check_pool_idle(engine);
}

TEST_CASE("EngineLoop: requests submitted from several threads stream their events") {
    REQUIRE_SHARED_OR_SKIP();
    infer::ThreadPool pool(2);
    infer::Engine engine(stories(), pool, config(32, 8));
    const auto prompts = mixed_prompts(6, stories().config.vocab_size, 9);
    std::mutex mutex;
    std::map<int, std::vector<int>> streamed;
    std::map<int, infer::FinishReason> reasons;
    std::vector<int> ids(prompts.size());
    {
        infer::EngineLoop loop(engine);
        std::vector<std::thread> clients;
        for (size_t i = 0; i < prompts.size(); ++i)
            clients.emplace_back([&, i] {
                ids[i] = loop.submit(prompts[i], seeded(16, i), {}, [&](const infer::Event& e) {
                    std::lock_guard lock(mutex);
                    streamed[e.request_id].insert(streamed[e.request_id].end(), e.token_ids.begin(), e.token_ids.end());
                    if (e.finished) reasons[e.request_id] = e.finish_reason;
                });
            });
        for (auto& client : clients) client.join();
        loop.wait_idle();
        for (size_t i = 0; i < prompts.size(); ++i) CHECK(loop.result(ids[i]).has_value());
    }
    for (size_t i = 0; i < prompts.size(); ++i) {
        CHECK(reasons[ids[i]] == infer::FinishReason::Length);
        CHECK(streamed[ids[i]] == alone(pool, prompts[i], seeded(16, i)));
    }
    check_pool_idle(engine);
}

TEST_CASE("step statistics and the Chrome trace") {
    REQUIRE_SHARED_OR_SKIP();
    infer::ThreadPool pool(2);
    infer::Engine engine(stories(), pool, config(16, 8));
    auto results = engine.generate(mixed_prompts(3, 512, 4), greedy(6));
    int prefill = 0, decode = 0;
    for (const infer::StepStats& s : engine.steps()) {
        CHECK(s.prefill_tokens + s.decode_tokens <= 16);
        CHECK(s.blocks_used + s.blocks_free + s.blocks_cached == engine.cache().num_blocks());
        prefill += s.prefill_tokens;
        decode += s.decode_tokens;
    }
    int prompt_tokens = 0, generated = 0;
    for (const auto& r : results) {
        prompt_tokens += static_cast<int>(r.prompt_ids.size());
        generated += static_cast<int>(r.generated_ids.size());
    }
    CHECK(prefill == prompt_tokens);
    CHECK(decode == generated - 3);  // each request's first token comes from its prefill
    std::ostringstream trace;
    infer::write_chrome_trace(trace, engine.steps(), results);
    infer::Json json = infer::Json::parse(trace.str(), "trace");
    const auto& events = json.at("traceEvents").as_array();
    size_t complete = 0;
    for (const infer::Json& e : events) complete += e.at("ph").as_string() == "X";
    CHECK(complete == engine.steps().size() + 3 * 3);  // each step, and queued/prefill/decode per request
    size_t token_marks = 0;
    for (const infer::Json& e : events) token_marks += e.at("ph").as_string() == "i";
    CHECK(token_marks == static_cast<size_t>(generated));  // one instant per sampled token on its request's track

    // Each request's time splits into waiting and its share of steps, and the parts add up to its whole life.
    for (const auto& r : results) {
        const infer::RequestBreakdown& b = r.times.breakdown;
        CHECK(b.total() == doctest::Approx(r.times.finished - r.times.arrival).epsilon(1e-9));
        CHECK(b.prefill > 0);
        CHECK(b.decode > 0);
        CHECK(b.schedule > 0);
        CHECK(b.queue >= 0);
    }
}

TEST_CASE("infer run-batch: OpenAI Batch lines in, one output line each, in order") {
    REQUIRE_SHARED_OR_SKIP();
    test::TempDir dir("run-batch");
    const std::string model = (test::shared_dir() / "models/stories260K/stories260K.gguf").string();
    test::write_file(dir / "in.jsonl",
                     R"({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "Once upon a time", "max_tokens": 20, "temperature": 0}})" "\n"
                     R"({"custom_id": "b", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 8, "temperature": 0.7, "seed": 3}})" "\n"
                     "not json\n"
                     R"({"custom_id": "c", "method": "POST", "url": "/v1/embeddings", "body": {}})" "\n"
                     R"({"custom_id": "d", "method": "POST", "url": "/v1/completions", "body": {"prompt": [1, 403, 407], "max_tokens": 5000}})" "\n"
                     R"({"custom_id": "e", "method": "POST", "url": "/v1/completions", "body": {"prompt": "Once upon a time", "max_tokens": 20, "temperature": 0, "stop": ["the"]}})" "\n");
    for (std::string policy : {"continuous", "static"}) {
        test::ProgramRun run = test::run_infer({"run-batch", "-m", model, "-i", (dir / "in.jsonl").string(), "-o",
                                                (dir / "out.jsonl").string(), "--chat-template", "chatml", "--policy", policy,
                                                "--max-batch-tokens", "8", "--block-size", "4", "--trace", (dir / "trace.json").string()});
        CAPTURE(run.err);
        REQUIRE(run.exit_code == 0);
        CHECK(run.err.find("requests: 6 (3 failed)") != std::string::npos);
        CHECK(run.err.find("prefix cache: ") != std::string::npos);
        std::vector<infer::Json> lines;
        std::istringstream out(infer::read_text_file(dir / "out.jsonl"));
        for (std::string line; std::getline(out, line);) lines.push_back(infer::Json::parse(line));
        REQUIRE(lines.size() == 6);
        // The completion: the text generate gives for the same prompt, and its usage.
        infer::ThreadPool pool(2);
        infer::SamplingParams greedy_20 = greedy(20);
        auto expected = infer::generate(stories(), pool, "Once upon a time", greedy_20);
        const infer::Json& a = lines[0].at("response").at("body");
        CHECK(lines[0].at("custom_id").as_string() == "a");
        CHECK(lines[0].at("response").at("status_code").as_int() == 200);
        CHECK(a.at("object").as_string() == "text_completion");
        CHECK(a.at("choices").as_array()[0].at("text").as_string() == expected.text);
        CHECK(a.at("choices").as_array()[0].at("finish_reason").as_string() == infer::finish_reason_name(expected.finish_reason));
        CHECK(a.at("usage").at("completion_tokens").as_int() == static_cast<int64_t>(expected.generated_ids.size()));
        // The chat reply.
        const infer::Json& b = lines[1].at("response").at("body");
        CHECK(b.at("object").as_string() == "chat.completion");
        CHECK(b.at("choices").as_array()[0].at("message").at("role").as_string() == "assistant");
        CHECK(b.at("usage").at("completion_tokens").as_int() <= 8);
        // Bad lines get error lines.
        CHECK(lines[2].at("error").at("message").as_string().find("line 3") != std::string::npos);
        CHECK(lines[3].at("error").at("message").as_string().find("/v1/embeddings") != std::string::npos);
        CHECK(lines[4].at("error").at("message").as_string() ==
              "the prompt (3 tokens) plus max_tokens (5000) exceed the model's context of 2048 tokens");
        // The stop string cuts the text before it.
        const std::string text_e = lines[5].at("response").at("body").at("choices").as_array()[0].at("text").as_string();
        CHECK(text_e == expected.text.substr(0, expected.text.find("the")));
        CHECK(lines[5].at("response").at("body").at("choices").as_array()[0].at("finish_reason").as_string() == "stop");
        infer::Json trace = test::read_json(dir / "trace.json");
        CHECK(trace.at("traceEvents").as_array().size() > 4);
    }
    test::ProgramRun bad = test::run_infer({"run-batch", "-m", model, "-i", (dir / "in.jsonl").string()});
    CHECK(bad.exit_code == 1);
    CHECK(bad.err.find("infer run-batch needs -o") != std::string::npos);
}

TEST_CASE("logprobs: the sampled token's log-probability and the likeliest alternatives, from llama.cpp's logits") {
    REQUIRE_SHARED_OR_SKIP();
    const auto [ids, prompt_length, reference] = test::stories_logits();
    const size_t V = 512, last = ids.size() - 1;
    // The reference distribution at the last position, in double.
    std::vector<double> expected(V);
    double max = -1e30, sum = 0;
    for (size_t v = 0; v < V; ++v) max = std::max(max, static_cast<double>(reference[last * V + v]));
    for (size_t v = 0; v < V; ++v) sum += std::exp(reference[last * V + v] - max);
    for (size_t v = 0; v < V; ++v) expected[v] = reference[last * V + v] - max - std::log(sum);
    std::vector<int> order(V);
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](int a, int b) { return expected[a] > expected[b]; });

    infer::ThreadPool pool(2);
    infer::Engine engine(stories(), pool, config(512, 16));
    infer::SamplingParams params = greedy(1);
    params.ignore_eos = true;
    params.logprobs = 5;
    int id = engine.add_request(ids, params);
    std::vector<infer::Event> events;
    while (engine.has_work())
        for (const infer::Event& e : engine.step()) events.push_back(e);
    REQUIRE(events.size() == 1);
    REQUIRE(events[0].logprobs.size() == 1);
    const infer::RequestResult result = *engine.take_result(id);
    REQUIRE(result.logprobs.size() == 1);
    const infer::TokenLogprob& lp = result.logprobs[0];
    CHECK(lp.id == order[0]);  // greedy took the likeliest token
    CHECK(std::abs(lp.logprob - expected[order[0]]) < 1e-3);
    REQUIRE(lp.top.size() == 5);
    for (size_t i = 0; i < 5; ++i) {
        CHECK(lp.top[i].first == order[i]);
        CHECK(std::abs(lp.top[i].second - expected[order[i]]) < 1e-3);
    }
    CHECK(events[0].logprobs[0].logprob == lp.logprob);

    // Out of range: refused with the parameter named.
    params.logprobs = 21;
    int bad = engine.add_request(ids, params);
    infer::Event refused;
    while (engine.has_work())
        for (const infer::Event& e : engine.step()) refused = e;
    CHECK(refused.request_id == bad);
    CHECK(refused.error.find("logprobs") != std::string::npos);
}

TEST_CASE("a Model reads its tokenizer once: generate() from text reuses it, engines share it") {
    REQUIRE_SHARED_OR_SKIP();
    // A small random model with Llama 2's vocabulary and its tokenizer.json beside it, as a Hugging Face folder.
    test::TempDir dir("tokenizer-once");
    auto folder = dir / "m";
    infer::save_random_model(folder, {.dim = 32, .n_layers = 1, .n_heads = 2, .n_kv_heads = 1, .ffn_dim = 64,
                                      .vocab_size = 32000, .context_length = 64}, infer::DType::F32, 3);
    for (const char* file : {"tokenizer.json", "tokenizer_config.json"})
        std::filesystem::copy_file(test::shared_dir() / "tokenizers/llama2" / file, folder / file);
    infer::Model model = infer::load_model(folder);
    infer::ThreadPool pool(1);
    infer::SamplingParams params;
    params.temperature = 0;
    params.max_tokens = 3;
    params.ignore_eos = true;
    infer::GenerationResult first = infer::generate(model, pool, "Hello world", params);
    CHECK(first.prompt_ids == std::vector<int>{1, 15043, 3186});
    // With the file gone, only a tokenizer kept in the Model can still encode: every later call uses that one.
    std::filesystem::remove(folder / "tokenizer.json");
    CHECK(infer::has_tokenizer(model));
    infer::GenerationResult second = infer::generate(model, pool, "Hello world", params);
    CHECK(second.prompt_ids == first.prompt_ids);
    CHECK(second.generated_ids == first.generated_ids);
    infer::Engine engine(model, pool);
    REQUIRE(engine.tokenizer());
    CHECK(engine.tokenizer()->encode("Hello world") == first.prompt_ids);
    // A moved Model takes its tokenizer along; a fresh load of the folder has none to read.
    infer::Model moved = std::move(model);
    CHECK(infer::tokenizer_for(moved).encode("Hello world") == first.prompt_ids);
    infer::Model reloaded = infer::load_model(folder);
    CHECK(!infer::has_tokenizer(reloaded));
    CHECK(test::error_of([&] { infer::tokenizer_for(reloaded); }).find("no tokenizer.json") != std::string::npos);
}

TEST_CASE("an engine that runs for thousands of steps keeps bounded bookkeeping: the latest steps and no finished request") {
    REQUIRE_SHARED_OR_SKIP();
    infer::ThreadPool pool(2);
    infer::EngineConfig settings;
    settings.step_history = 32;
    infer::Engine engine(stories(), pool, settings);
    infer::SamplingParams params = greedy(200);
    params.ignore_eos = true;
    size_t most_steps = 0, most_capacity = 0;
    std::vector<int> first_ids;
    for (int request = 0; request < 30; ++request) {  // 30 requests one after another, each 200 decode steps
        const int id = engine.add_request(std::vector<int>{1, 403, 407}, params);
        while (engine.has_work()) {
            engine.step();
            most_steps = std::max(most_steps, engine.steps().size());
            most_capacity = std::max(most_capacity, engine.steps().capacity());
        }
        std::optional<infer::RequestResult> result = engine.take_result(id);
        REQUIRE(result);
        CHECK(result->generated_ids.size() == 200);
        if (request == 0) first_ids = result->generated_ids;
        CHECK(result->generated_ids == first_ids);  // the same request gives the same ids however long the engine ran
        CHECK(!engine.take_result(id));             // handed over once, then forgotten
    }
    CHECK(engine.totals().steps >= 6000);
    CHECK(most_steps < 2 * settings.step_history);
    CHECK(most_capacity <= 4 * settings.step_history);
    CHECK(engine.steps().back().decode_tokens == 1);  // the latest step is kept
    check_pool_idle(engine);
}
