// Speculative decoding: proposers, the verification rule and the engine's rollback. The references are the same
// requests decoded without speculation (generate_from_ids, whose own tests check it against llama.cpp and llama2.c,
// and stories260K's published greedy ids): greedy output must match them token for token, and sampled output must
// follow the target's distribution, which the chi-square tests compare against probabilities computed directly.
#include "support.hpp"

namespace {

const infer::Model& stories() {
    static infer::Model model = infer::load_model(test::shared_dir() / "models/stories260K/stories260K.gguf");
    return model;
}

// The tiny random-weight models of the architecture fixtures, shared (a draft model is held by shared_ptr).
std::shared_ptr<const infer::Model> fixture(const std::string& family) {
    static std::map<std::string, std::shared_ptr<const infer::Model>> models;
    auto& model = models[family];
    if (!model) model = std::make_shared<infer::Model>(infer::load_model(test::shared_dir() / "fixtures/arch" / family));
    return model;
}

std::shared_ptr<const infer::Model> stories_shared() {
    static auto model = std::make_shared<infer::Model>(infer::load_model(test::shared_dir() / "models/stories260K/stories260K.gguf"));
    return model;
}

using test::greedy;
using test::seeded;

infer::SpecConfig ngram(int k, int n = 3) {
    infer::SpecConfig spec;
    spec.method = infer::SpecMethod::Ngram;
    spec.k = k;
    spec.ngram = n;
    return spec;
}

infer::SpecConfig draft(int k, std::shared_ptr<const infer::Model> model) {
    infer::SpecConfig spec;
    spec.method = infer::SpecMethod::Draft;
    spec.k = k;
    spec.draft_model = std::move(model);
    return spec;
}

// Guesses that are almost always wrong (the previous id plus one): every step rolls back.
class WrongProposer : public infer::Proposer {
public:
    explicit WrongProposer(int vocab) : vocab_(vocab) {}
    void propose(std::span<infer::DraftRequest> requests) override {
        for (infer::DraftRequest& r : requests) {
            r.draft.clear();
            for (int i = 0; i < r.max_tokens; ++i) r.draft.push_back((r.tokens.back() + 1 + i) % vocab_);
        }
    }

private:
    int vocab_;
};

// One guess looked up by the last id (one-hot), or none.
class TableProposer : public infer::Proposer {
public:
    explicit TableProposer(std::map<int, int> guesses) : guesses_(std::move(guesses)) {}
    void propose(std::span<infer::DraftRequest> requests) override {
        for (infer::DraftRequest& r : requests) {
            r.draft.clear();
            if (auto found = guesses_.find(r.tokens.back()); found != guesses_.end()) r.draft.push_back(found->second);
        }
    }

private:
    std::map<int, int> guesses_;
};

infer::EngineConfig engine_config(infer::SpecConfig spec, int max_batch_tokens = 512, int block_size = 16, int num_blocks = 0) {
    infer::EngineConfig config;
    config.spec = std::move(spec);
    config.scheduler.max_batch_tokens = max_batch_tokens;
    config.block_size = block_size;
    config.num_blocks = num_blocks;
    return config;
}

std::vector<infer::RequestResult> run(const infer::Model& model, infer::ThreadPool& pool, const infer::EngineConfig& config,
                                      const std::vector<std::vector<int>>& prompts, const std::vector<infer::SamplingParams>& params) {
    infer::Engine engine(model, pool, config);
    std::vector<int> ids;
    for (size_t i = 0; i < prompts.size(); ++i) ids.push_back(engine.add_request(prompts[i], params[i]));
    while (engine.has_work()) engine.step();
    std::vector<infer::RequestResult> results;
    for (int id : ids) results.push_back(*engine.take_result(id));
    CHECK(engine.cache().used_block_count() == 0);
    return results;
}

struct Reference {
    std::string name;
    std::vector<int> prompt, generated;
};

std::vector<Reference> stories_references() {
    std::vector<Reference> references;
    for (const char* name : {"empty", "lily_and_ben", "once_upon_a_time", "the_cat"}) {
        infer::Json json = test::read_json(test::shared_dir() / "models/stories260K/public" / (std::string(name) + ".json"));
        references.push_back({name, test::ids_of(json.at("prompt_ids")), test::ids_of(json.at("generated_ids"))});
    }
    return references;
}

std::vector<int> fixture_ids(const std::string& family, const char* sequence) {
    infer::Json manifest = test::read_json(test::shared_dir() / "fixtures/arch" / family / "manifest.json");
    return test::ids_of(manifest.at("sequences").at(sequence).at("ids"));
}

// Pearson's chi-square of observed counts against probabilities, bins with an expected count under 5 pooled.
// Returns {statistic, degrees of freedom}.
std::pair<double, int> chi_square(const std::map<int, int>& observed, const std::vector<double>& p, int n) {
    double statistic = 0, pooled_expected = 0, pooled_observed = 0;
    int bins = 0;
    for (size_t id = 0; id < p.size(); ++id) {
        const double expected = p[id] * n;
        auto found = observed.find(static_cast<int>(id));
        const double seen = found == observed.end() ? 0 : found->second;
        if (expected < 5) {
            pooled_expected += expected;
            pooled_observed += seen;
            continue;
        }
        statistic += (seen - expected) * (seen - expected) / expected;
        ++bins;
    }
    if (pooled_expected > 0) {
        statistic += (pooled_observed - pooled_expected) * (pooled_observed - pooled_expected) / std::max(pooled_expected, 1.0);
        ++bins;
    }
    return {statistic, bins - 1};
}

// A generous bound: the chi-square quantile far in the tail (mean df, sd sqrt(2 df)), so only a wrong distribution
// fails, never a fixed seed's bad luck.
double chi_square_bound(int df) { return df + 8 * std::sqrt(2.0 * df) + 10; }

}  // namespace

TEST_CASE("n-gram lookup guesses what followed the most recent match of the longest suffix") {
    using infer::NgramProposer;
    // "5 6 7" occurred at 0 and at 6; the most recent earlier match (6) is followed by 9 9.
    std::vector<int> tokens{5, 6, 7, 8, 1, 2, 5, 6, 7, 9, 9, 4, 5, 6, 7};
    CHECK(NgramProposer::lookup(tokens, 3, 2) == std::vector<int>{9, 9});
    // Past the end of the text the copy reads its own guesses: "5 6 7" comes round again, so "9 9" follows it.
    CHECK(NgramProposer::lookup(tokens, 3, 8) == std::vector<int>{9, 9, 4, 5, 6, 7, 9, 9});
    // No earlier "3 4": fall back to "4", which occurred at 11.
    std::vector<int> shorter{1, 4, 2, 9, 3, 4};
    CHECK(NgramProposer::lookup(shorter, 2, 3) == std::vector<int>{2, 9, 3});
    CHECK(NgramProposer::lookup(shorter, 1, 1) == std::vector<int>{2});
    // Nothing repeats: nothing to guess. A single id, k 0: nothing either.
    CHECK(NgramProposer::lookup(std::vector<int>{1, 2, 3}, 3, 4).empty());
    CHECK(NgramProposer::lookup(std::vector<int>{1}, 3, 4).empty());
    CHECK(NgramProposer::lookup(tokens, 3, 0).empty());
    // A run of one id predicts more of it, and a short cycle goes round as many times as k asks.
    CHECK(NgramProposer::lookup(std::vector<int>{7, 7, 7, 7}, 3, 4) == std::vector<int>{7, 7, 7, 7});
    CHECK(NgramProposer::lookup(std::vector<int>{1, 2, 1, 2}, 3, 5) == std::vector<int>{1, 2, 1, 2, 1});
    CHECK(test::error_of([] { infer::NgramProposer(0); }).find("at least 1") != std::string::npos);
}

TEST_CASE("KVCache::truncate gives back the blocks past a length and never cuts into named blocks") {
    infer::ModelConfig c = infer::config_for_shape({.dim = 32, .n_layers = 1, .n_heads = 2, .n_kv_heads = 1, .ffn_dim = 64,
                                                    .vocab_size = 100, .context_length = 128});
    infer::KVCache cache(c, 8, 4);
    std::vector<int> ids{1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
    REQUIRE(cache.reserve(0, 18));  // 5 blocks
    CHECK(cache.used_block_count() == 5);
    cache.commit(0, ids, 8);  // two full blocks named
    cache.truncate(0, 9);     // keeps 3 blocks: positions 0..8
    CHECK(cache.block_table(0).size() == 3);
    CHECK(cache.used_block_count() == 3);
    CHECK(cache.free_block_count() == 5);
    cache.truncate(0, 12);  // nothing past 12 is held: no change
    CHECK(cache.block_table(0).size() == 3);
    CHECK(test::error_of([&] { cache.truncate(0, 3); }).find("named blocks") != std::string::npos);
    cache.truncate(7, 0);  // an unknown sequence: nothing to do
    cache.release(0);
    CHECK(cache.used_block_count() == 0);
    CHECK(cache.cached_block_count() == 2);
}

TEST_CASE("the verification rule leaves the target's distribution: one-hot and general drafts, truncation applied") {
    // p: 12 logits through temperature 0.8, top-k 8 and top-p 0.97; q: a different distribution over all 12 ids.
    const std::vector<float> logits{2.0f, 1.5f, 1.2f, 0.9f, 0.5f, 0.4f, 0.0f, -0.3f, -0.6f, -1.0f, 1.0f, 0.2f};
    infer::SamplingParams params;
    params.temperature = 0.8f;
    params.top_k = 8;
    params.top_p = 0.97f;
    params.seed = 11;
    std::vector<float> p_float;
    std::vector<float> scratch = logits;
    infer::Sampler(params, 12).distribution(scratch, p_float);
    std::vector<double> p(p_float.begin(), p_float.end());
    CHECK(std::count_if(p.begin(), p.end(), [](double x) { return x > 0; }) <= 8);
    std::vector<float> q{0.02f, 0.05f, 0.3f, 0.02f, 0.1f, 0.01f, 0.2f, 0.05f, 0.05f, 0.1f, 0.05f, 0.05f};

    const int n = 40000;
    for (int mode = 0; mode < 3; ++mode) {  // 0: one-hot on a likely id, 1: one-hot on an id p excludes, 2: q
        CAPTURE(mode);
        infer::Sampler sampler(params, 12);
        std::mt19937_64 proposer_rng(99);
        std::map<int, int> counts;
        for (int trial = 0; trial < n; ++trial) {
            int drafted = mode == 0 ? 1 : mode == 1 ? 9 : -1;
            std::span<const float> qs;
            if (mode == 2) {  // draw the guess from q
                double u = static_cast<double>(proposer_rng() >> 11) * 0x1.0p-53, mass = 0;
                drafted = 11;
                for (int id = 0; id < 12; ++id)
                    if ((mass += q[id]) > u) {
                        drafted = id;
                        break;
                    }
                qs = q;
            }
            std::vector<float> row = logits;
            ++counts[infer::verify_draft_token(sampler, row, drafted, qs, scratch)];
        }
        for (const auto& entry : counts) CHECK_MESSAGE(p[entry.first] > 0, "id " << entry.first << " is outside p's support");
        double statistic;  // named variables, not a structured binding: CAPTURE's lambda must be able to see them
        int df;
        std::tie(statistic, df) = chi_square(counts, p, n);
        CAPTURE(statistic);
        CHECK(df >= 5);
        CHECK(statistic < chi_square_bound(df));
    }
}

TEST_CASE("greedy speculative decoding reproduces stories260K's reference ids: k 1, 2, 4, 8, each proposer, alone") {
    REQUIRE_SHARED_OR_SKIP();
    infer::ThreadPool pool(2);
    const std::vector<Reference> references = stories_references();
    struct Setup {
        const char* name;
        std::function<infer::SpecConfig(int)> spec;
    };
    const std::vector<Setup> setups = {
        {"ngram", [](int k) { return ngram(k); }},
        {"ngram n=1", [](int k) { return ngram(k, 1); }},
        {"draft: itself", [](int k) { return draft(k, stories_shared()); }},
        {"draft: a random model", [](int k) { return draft(k, fixture("smollm")); }},
        {"always wrong", [](int k) {
             infer::SpecConfig spec;
             spec.k = k;
             spec.proposer = std::make_shared<WrongProposer>(512);
             return spec;
         }},
    };
    for (const Setup& setup : setups)
        for (int k : {1, 2, 4, 8}) {
            CAPTURE(setup.name);
            CAPTURE(k);
            int64_t drafted = 0, accepted = 0;
            for (const Reference& reference : references) {
                CAPTURE(reference.name);
                infer::RequestResult result = run(stories(), pool, engine_config(setup.spec(k)), {reference.prompt},
                                                  {greedy(static_cast<int>(reference.generated.size()))})[0];
                CHECK(result.generated_ids == reference.generated);
                CHECK(result.accepted_tokens <= result.draft_tokens);
                CHECK(result.draft_steps <= static_cast<int>(reference.generated.size()));
                drafted += result.draft_tokens;
                accepted += result.accepted_tokens;
            }
            CHECK(drafted > 0);
            if (std::string(setup.name) == "draft: itself") CHECK(accepted == drafted);  // the same model agrees with itself
            if (std::string(setup.name) == "always wrong") CHECK(accepted * 10 < drafted);
        }
}

TEST_CASE("greedy speculative decoding, batched with other sequences under a small budget and a small KV pool") {
    REQUIRE_SHARED_OR_SKIP();
    infer::ThreadPool pool(2);
    const std::vector<Reference> references = stories_references();
    std::vector<std::vector<int>> prompts;
    std::vector<infer::SamplingParams> params;
    std::vector<std::vector<int>> expected;
    for (const Reference& r : references) {
        prompts.push_back(r.prompt);
        params.push_back(greedy(static_cast<int>(r.generated.size())));
        expected.push_back(r.generated);
    }
    // Other sequences beside them: random prompts, some sampled (their outputs must not change either).
    std::mt19937_64 rng(5);
    for (int i = 0; i < 6; ++i) {
        std::vector<int> prompt{1};
        while (static_cast<int>(prompt.size()) < 3 + static_cast<int>(rng() % 40)) prompt.push_back(3 + static_cast<int>(rng() % 509));
        prompts.push_back(prompt);
        params.push_back(i % 2 ? seeded(30, 100 + i) : greedy(40));
        expected.push_back(infer::generate_from_ids(stories(), pool, prompt, greedy(40)).generated_ids);
    }
    for (auto make : {std::function<infer::SpecConfig(int)>([](int k) { return ngram(k); }),
                      std::function<infer::SpecConfig(int)>([](int k) { return draft(k, stories_shared()); })})
        for (int k : {1, 2, 4, 8}) {
            CAPTURE(k);
            // A budget of 24 tokens per step cuts drafts short; 40 blocks of 4 tokens force preemptions.
            infer::EngineConfig small = engine_config(make(k), 24, 4, 60);
            for (const infer::EngineConfig& config : {engine_config(make(k)), small}) {
                std::vector<infer::RequestResult> results = run(stories(), pool, config, prompts, params);
                std::vector<infer::RequestResult> plain = run(stories(), pool, engine_config({}), prompts, params);
                for (size_t i = 0; i < prompts.size(); ++i) {
                    CAPTURE(i);
                    if (params[i].temperature == 0) CHECK(results[i].generated_ids == expected[i]);
                    else CHECK(results[i].generated_ids.size() == plain[i].generated_ids.size());
                }
            }
        }
}

TEST_CASE("greedy speculative decoding on every architecture fixture matches decoding without it") {
    REQUIRE_SHARED_OR_SKIP();
    infer::ThreadPool pool(2);
    for (const char* family : {"llama", "llama3", "mistral", "qwen2", "qwen3", "smollm"}) {
        CAPTURE(family);
        const infer::Model& model = *fixture(family);
        std::vector<std::vector<int>> prompts{fixture_ids(family, "A"), fixture_ids(family, "B")};
        std::vector<infer::SamplingParams> params{greedy(80), greedy(512 - 40)};  // B runs until the context is full
        for (auto& p : params) p.ignore_eos = true;
        std::vector<std::vector<int>> expected;
        for (size_t i = 0; i < prompts.size(); ++i)
            expected.push_back(infer::generate_from_ids(model, pool, prompts[i], params[i]).generated_ids);
        CHECK(expected[1].size() == 472);
        const char* other = std::string(family) == "smollm" ? "llama" : "smollm";
        for (int k : {1, 2, 4, 8}) {
            CAPTURE(k);
            for (const infer::SpecConfig& spec : {ngram(k), draft(k, fixture(family)), draft(k, fixture(other))}) {
                CAPTURE(infer::spec_method_name(spec.method));
                // Alone, then both together.
                for (size_t i = 0; i < prompts.size(); ++i)
                    CHECK(run(model, pool, engine_config(spec), {prompts[i]}, {params[i]})[0].generated_ids == expected[i]);
                std::vector<infer::RequestResult> both = run(model, pool, engine_config(spec, 64, 8), prompts, params);
                CHECK(both[0].generated_ids == expected[0]);
                CHECK(both[1].generated_ids == expected[1]);
                CHECK(both[1].finish_reason == infer::FinishReason::Length);
            }
        }
    }
}

TEST_CASE("seeded speculative sampling repeats itself, alone or batched") {
    REQUIRE_SHARED_OR_SKIP();
    infer::ThreadPool pool(2);
    const std::vector<Reference> references = stories_references();
    std::vector<std::vector<int>> prompts;
    std::vector<infer::SamplingParams> params;
    for (size_t i = 0; i < references.size(); ++i) {
        prompts.push_back(references[i].prompt);
        infer::SamplingParams p = seeded(60, 7 + i);
        p.presence_penalty = i == 1 ? 0.5f : 0.0f;  // penalties shape p as the drafts are verified
        p.repetition_penalty = i == 2 ? 1.2f : 1.0f;
        params.push_back(p);
    }
    for (const infer::SpecConfig& spec : {ngram(4), draft(4, fixture("llama")), draft(3, stories_shared())}) {
        CAPTURE(infer::spec_method_name(spec.method));
        std::vector<infer::RequestResult> first = run(stories(), pool, engine_config(spec), prompts, params);
        std::vector<infer::RequestResult> again = run(stories(), pool, engine_config(spec), prompts, params);
        for (size_t i = 0; i < prompts.size(); ++i) {
            CHECK(first[i].generated_ids == again[i].generated_ids);
            CHECK(first[i].seed == 7 + i);
            CHECK(run(stories(), pool, engine_config(spec), {prompts[i]}, {params[i]})[0].generated_ids == first[i].generated_ids);
        }
    }
}

TEST_CASE("sampled speculative decoding follows the target's distribution over two tokens (chi-square, stories260K)") {
    REQUIRE_SHARED_OR_SKIP();
    infer::ThreadPool pool(2);
    const std::vector<int> prompt = stories_references()[3].prompt;  // BOS "The cat": a broad first-token distribution
    const int n = 3000;
    infer::SamplingParams params;
    params.temperature = 1.0f;
    params.max_tokens = 3;  // the first id from the prefill, the second a verified guess (the third: a bonus, or none)
    params.ignore_eos = true;

    // The target's own p(· | ids) at temperature 1, from one forward pass.
    infer::ForwardPass forward(stories(), pool);
    auto target_p = [&](const std::vector<int>& ids) {
        infer::KVCache cache(stories().config, 4, 16);
        REQUIRE(cache.reserve(0, static_cast<int>(ids.size())));
        infer::Batch batch;
        for (size_t i = 0; i < ids.size(); ++i) batch.add(ids[i], static_cast<int>(i), 0, i + 1 == ids.size());
        std::span<const float> row = forward.forward(batch, cache);
        std::vector<float> logits(row.begin(), row.end()), p;
        infer::Sampler(params, stories().config.vocab_size).distribution(logits, p);
        return std::vector<double>(p.begin(), p.end());
    };
    // The expected joint distribution of (first, second) as one vector over first · V + second: each likely first id
    // with its own p(second | first); the unlikely firsts' mass lands in the pooled bin.
    const size_t V = static_cast<size_t>(stories().config.vocab_size);
    std::vector<double> first_p = target_p(prompt), joint(V * V, 0.0);
    std::map<int, int> guesses;  // after each likely first id, the second id whose probability is nearest 1/2
    for (size_t first = 0; first < V; ++first) {
        if (first_p[first] * n < 5) continue;
        std::vector<int> ids = prompt;
        ids.push_back(static_cast<int>(first));
        std::vector<double> second_p = target_p(ids);
        for (size_t second = 0; second < V; ++second) joint[first * V + second] = first_p[first] * second_p[second];
        guesses[static_cast<int>(first)] = static_cast<int>(std::min_element(second_p.begin(), second_p.end(), [](double a, double b) {
                                               return std::abs(a - 0.5) < std::abs(b - 0.5);
                                           }) - second_p.begin());
    }

    // One-hot guesses, each as likely to be kept as not where possible; and a random model's q.
    std::vector<std::pair<std::string, infer::SpecConfig>> setups;
    infer::SpecConfig table;
    table.k = 1;
    table.proposer = std::make_shared<TableProposer>(guesses);
    setups.emplace_back("one-hot guesses", table);
    setups.emplace_back("a random draft model's q", draft(1, fixture("qwen3")));
    for (const auto& setup : setups) {
        const std::string& name = setup.first;
        const infer::SpecConfig& spec = setup.second;
        CAPTURE(name);
        infer::EngineConfig config = engine_config(spec);
        config.scheduler.max_seqs = 256;
        infer::Engine engine(stories(), pool, config);
        for (int seed = 0; seed < n; ++seed) {
            infer::SamplingParams p = params;
            p.seed = static_cast<uint64_t>(seed);
            engine.add_request(prompt, p);
        }
        std::map<int, int> counts;
        int64_t drafted = 0, accepted = 0;
        while (engine.has_work())
            for (const infer::Event& event : engine.step())
                if (event.finished) {
                    infer::RequestResult r = *engine.take_result(event.request_id);
                    REQUIRE(r.generated_ids.size() == 3);
                    ++counts[r.generated_ids[0] * static_cast<int>(V) + r.generated_ids[1]];
                    drafted += r.draft_tokens;
                    accepted += r.accepted_tokens;
                }
        CHECK(drafted > n / 2);  // most second ids were verified guesses
        CHECK(accepted > 0);
        CHECK(accepted < drafted);
        double statistic;
        int df;
        std::tie(statistic, df) = chi_square(counts, joint, n);
        CAPTURE(statistic);
        CAPTURE(df);
        CHECK(df >= 10);
        CHECK(statistic < chi_square_bound(df));
    }
}

TEST_CASE("rejected guesses never reach the prefix cache: a later prompt that reuses the blocks gets the same logits") {
    REQUIRE_SHARED_OR_SKIP();
    infer::ThreadPool pool(2);
    const std::vector<int> prompt = stories_references()[1].prompt;
    infer::SamplingParams params = greedy(48);
    params.logprobs = 3;  // raw log-probabilities: any wrong K/V in a reused block would change them

    infer::SpecConfig wrong;
    wrong.k = 4;
    wrong.proposer = std::make_shared<WrongProposer>(512);
    infer::Engine engine(stories(), pool, engine_config(wrong, 512, 2));  // blocks of 2: many are named
    int id = engine.add_request(prompt, params);
    while (engine.has_work()) {
        engine.step();
        // One request: it holds at most the blocks for its ids so far (rejected guesses' blocks went back).
        CHECK(engine.cache().used_block_count() <= (static_cast<int>(prompt.size()) + 48 + 1) / 2);
    }
    infer::RequestResult first = *engine.take_result(id);
    CHECK(first.draft_tokens > 100);
    const std::vector<int> reference = stories_references()[1].generated;
    CHECK(first.generated_ids == std::vector<int>(reference.begin(), reference.begin() + 48));

    // The prompt and most of the output again, through the same engine: its blocks come from the prefix cache.
    std::vector<int> follow_up = prompt;
    follow_up.insert(follow_up.end(), first.generated_ids.begin(), first.generated_ids.begin() + 40);
    infer::SamplingParams next = greedy(8);
    next.logprobs = 3;
    int again = engine.add_request(follow_up, next);
    while (engine.has_work()) engine.step();
    infer::RequestResult cached = *engine.take_result(again);
    CHECK(cached.cached_tokens >= 40);

    infer::EngineConfig cold_config = engine_config({});
    cold_config.prefix_caching = false;
    infer::RequestResult cold = run(stories(), pool, cold_config, {follow_up}, {next})[0];
    CHECK(cached.generated_ids == cold.generated_ids);
    REQUIRE(cached.logprobs.size() == cold.logprobs.size());
    for (size_t i = 0; i < cold.logprobs.size(); ++i) {
        CHECK(cached.logprobs[i].logprob == cold.logprobs[i].logprob);
        CHECK(cached.logprobs[i].top == cold.logprobs[i].top);
    }
}

TEST_CASE("speculative decoding refuses what cannot work, naming it") {
    REQUIRE_SHARED_OR_SKIP();
    infer::ThreadPool pool(1);
    infer::SpecConfig no_model;
    no_model.method = infer::SpecMethod::Draft;
    CHECK(test::error_of([&] { infer::Engine(stories(), pool, engine_config(no_model)); }).find("--draft-model") != std::string::npos);
    infer::SpecConfig zero = ngram(0);
    CHECK(test::error_of([&] { infer::Engine(stories(), pool, engine_config(zero)); }).find("1..64") != std::string::npos);
    // A draft model with another vocabulary: both sizes in the message.
    auto other = std::make_shared<infer::Model>(infer::demo_model());  // a byte vocabulary of 260 tokens
    std::string message = test::error_of([&] { infer::Engine(stories(), pool, engine_config(draft(4, other))); });
    CHECK(message.find("260") != std::string::npos);
    CHECK(message.find("512") != std::string::npos);
    CHECK(test::error_of([] { infer::parse_spec_method("medusa"); }).find("ngram, draft or none") != std::string::npos);
}

TEST_CASE("infer generate --spec: the same ids as without, acceptance on the stats line; bad options named") {
    REQUIRE_SHARED_OR_SKIP();
    const std::string dir = (test::shared_dir() / "models/stories260K").string();
    const std::string model = dir + "/stories260K.gguf";
    const Reference reference = stories_references()[2];
    std::string prompt_ids;
    for (int id : reference.prompt) prompt_ids += (prompt_ids.empty() ? "" : ",") + std::to_string(id);
    std::string expected_ids;
    for (int id : reference.generated) expected_ids += (expected_ids.empty() ? "" : ",") + std::to_string(id);
    const std::vector<std::vector<std::string>> variants = {
        {"--spec", "ngram"},
        {"--spec", "ngram", "--spec-k", "8", "--spec-ngram", "2"},
        {"--spec", "draft", "--draft-model", dir + "/stories260K.bin", "--spec-k", "2"},
        {"--draft-model", model},  // --draft-model alone means draft
    };
    for (const std::vector<std::string>& spec : variants) {
        std::vector<std::string> args = {"generate", "-m", model, "--prompt-ids", prompt_ids, "-n", "200", "--temp", "0", "--ids", "-t", "2"};
        args.insert(args.end(), spec.begin(), spec.end());
        test::ProgramRun run = test::run_infer(args);
        CAPTURE(run.err);
        REQUIRE(run.exit_code == 0);
        CHECK(run.out.find("\"generated_ids\":[" + expected_ids + "]") != std::string::npos);
        CHECK(run.err.find("accepted (") != std::string::npos);
        CHECK(run.err.find("tokens per verifying step") != std::string::npos);
    }
    auto error = [&](std::vector<std::string> options) {
        std::vector<std::string> args = {"generate", "-m", model, "-p", "Hi", "-n", "4"};
        args.insert(args.end(), options.begin(), options.end());
        test::ProgramRun run = test::run_infer(args);
        CHECK(run.exit_code == 1);
        CHECK(run.out.empty());
        return run.err;
    };
    CHECK(error({"--spec", "medusa"}).find("unknown speculative method 'medusa'") != std::string::npos);
    CHECK(error({"--spec", "draft"}).find("--draft-model PATH") != std::string::npos);
    CHECK(error({"--spec-k", "3"}).find("--spec-k needs --spec") != std::string::npos);
    CHECK(error({"--spec", "ngram", "--spec-k", "0"}).find("--spec-k: 0 is out of range (1..64)") != std::string::npos);
    CHECK(error({"--spec", "ngram", "--draft-model", model}).find("--draft-model is for --spec draft") != std::string::npos);
    test::TempDir other("spec-vocab");
    REQUIRE(test::run_infer({"make-model", "-o", other.path().string(), "--dim", "16", "--layers", "1", "--heads", "2",
                             "--ffn", "32", "--vocab", "300", "--context", "64"}).exit_code == 0);
    std::string message = error({"--spec", "draft", "--draft-model", other.path().string()});
    CHECK(message.find("vocabulary of 300 tokens") != std::string::npos);
    CHECK(message.find("512") != std::string::npos);
}

TEST_CASE("infer run-batch --spec: the same output lines as without, the counts in the summary and the trace") {
    REQUIRE_SHARED_OR_SKIP();
    test::TempDir dir("spec-batch");
    const std::string model = (test::shared_dir() / "models/stories260K/stories260K.gguf").string();
    std::string lines;
    for (const char* prompt : {"Once upon a time", "Lily and Ben", "The cat", "One day"})
        lines += std::string(R"({"custom_id": ")") + prompt + R"(", "method": "POST", "url": "/v1/completions", "body": {"prompt": ")" +
                 prompt + R"(", "max_tokens": 60, "temperature": 0}})" "\n";
    test::write_file(dir / "in.jsonl", lines);
    auto bodies = [&](const std::vector<std::string>& extra) {
        std::vector<std::string> args = {"run-batch", "-m", model, "-i", (dir / "in.jsonl").string(), "-o", (dir / "out.jsonl").string(),
                                         "--trace", (dir / "trace.json").string(), "-t", "2"};
        args.insert(args.end(), extra.begin(), extra.end());
        test::ProgramRun run = test::run_infer(args);
        CAPTURE(run.err);
        REQUIRE(run.exit_code == 0);
        std::vector<std::string> texts;
        std::istringstream out(infer::read_text_file(dir / "out.jsonl"));
        for (std::string line; std::getline(out, line);)
            texts.push_back(infer::Json::parse(line).at("response").at("body").at("choices").as_array()[0].at("text").as_string());
        return std::make_pair(texts, run.err);
    };
    auto [plain, plain_err] = bodies({});
    CHECK(plain_err.find("speculative") == std::string::npos);
    auto [spec, spec_err] = bodies({"--spec", "ngram", "--spec-k", "5"});
    CHECK(spec == plain);
    CHECK(spec_err.find("speculative (ngram, k 5): ") != std::string::npos);
    infer::Json trace = test::read_json(dir / "trace.json");
    int64_t drafted = 0;
    for (const infer::Json& event : trace.at("traceEvents").as_array())
        if (const infer::Json* args = event.find("args"); args && event.at("name").as_string().rfind("step", 0) == 0)
            if (const infer::Json* d = args->find("draft_tokens")) {
                drafted += d->as_int();
                CHECK(args->at("accepted_tokens").as_int() <= d->as_int());
            }
    CHECK(drafted > 0);
}
