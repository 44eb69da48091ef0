// Sampler: greedy, seeded sampling, the filters and the penalties, and invalid parameters.
#include "support.hpp"

namespace {

infer::SamplingParams greedy() {
    infer::SamplingParams params;
    params.temperature = 0;
    return params;
}

int sample_once(const infer::SamplingParams& params, std::vector<float> logits) {
    infer::Sampler sampler(params, static_cast<int>(logits.size()));
    return sampler.sample(logits);
}

}  // namespace

TEST_CASE("temperature 0 is argmax, ties going to the lowest id") {
    CHECK(sample_once(greedy(), {0.1f, 3.0f, -1.0f, 3.0f}) == 1);
    CHECK(sample_once(greedy(), {-5.0f, -4.0f, -4.5f}) == 1);
}

TEST_CASE("a seed reproduces the same draws; another seed draws differently") {
    infer::SamplingParams params;
    params.temperature = 1.0f;
    std::vector<float> logits(50);
    for (int i = 0; i < 50; ++i) logits[i] = static_cast<float>(i % 7) * 0.3f;
    auto draws = [&](uint64_t seed) {
        params.seed = seed;
        infer::Sampler sampler(params, 50);
        std::vector<int> ids;
        for (int i = 0; i < 200; ++i) {
            std::vector<float> copy = logits;
            ids.push_back(sampler.sample(copy));
        }
        return ids;
    };
    CHECK(draws(42) == draws(42));
    CHECK(draws(42) != draws(43));
}

TEST_CASE("sampling at temperature 1 follows the softmax") {
    infer::SamplingParams params;
    params.seed = 7;
    std::vector<float> logits = {std::log(0.5f), std::log(0.3f), std::log(0.2f)};
    infer::Sampler sampler(params, 3);
    std::array<int, 3> counts{};
    const int draws = 20000;
    for (int i = 0; i < draws; ++i) {
        std::vector<float> copy = logits;
        counts[sampler.sample(copy)]++;
    }
    CHECK(counts[0] / double(draws) == doctest::Approx(0.5).epsilon(0.05));
    CHECK(counts[1] / double(draws) == doctest::Approx(0.3).epsilon(0.05));
    CHECK(counts[2] / double(draws) == doctest::Approx(0.2).epsilon(0.05));
}

TEST_CASE("top-k, top-p and min-p keep only the head of the distribution") {
    std::vector<float> logits = {1.0f, 4.0f, 3.9f, 0.5f, 3.8f};
    for (uint64_t seed = 0; seed < 200; ++seed) {
        infer::SamplingParams params;
        params.seed = seed;
        params.top_k = 1;
        CHECK(sample_once(params, logits) == 1);
        params.top_k = 2;
        int id = sample_once(params, logits);
        CHECK((id == 1 || id == 2));
        params.top_k = 0;
        params.top_p = 0.01f;  // the top token alone already holds more than 1%
        CHECK(sample_once(params, logits) == 1);
        params.top_p = 1.0f;
        params.min_p = 0.95f;  // exp(-0.1) = 0.905 < 0.95: only the top token survives
        CHECK(sample_once(params, logits) == 1);
        params.min_p = 0.85f;  // token 2 survives (0.905), token 4 (0.819) does not
        id = sample_once(params, logits);
        CHECK((id == 1 || id == 2));
    }
}

TEST_CASE("penalties: repetition divides seen positive logits, presence and frequency subtract") {
    infer::SamplingParams params = greedy();
    params.repetition_penalty = 2.0f;
    infer::Sampler sampler(params, 3);
    std::vector<int> prompt = {0};
    sampler.set_prompt(prompt);
    std::vector<float> logits = {3.0f, 2.0f, -1.0f};
    CHECK(sampler.sample(logits) == 1);  // 3 / 2 = 1.5 < 2
    CHECK(logits[0] == 1.5f);

    params = greedy();
    params.presence_penalty = 0.5f;
    params.frequency_penalty = 0.25f;
    infer::Sampler penalized(params, 3);
    penalized.accept(0);
    penalized.accept(0);
    logits = {3.0f, 2.0f, 0.0f};
    penalized.sample(logits);
    CHECK(logits[0] == doctest::Approx(3.0f - 0.5f - 0.5f));
    CHECK(logits[1] == 2.0f);
}

TEST_CASE("invalid sampling parameters are errors naming the parameter") {
    auto message = [](auto change) {
        infer::SamplingParams params;
        change(params);
        return test::error_of([&] { params.validate(); });
    };
    CHECK(message([](auto& p) { p.temperature = -1; }).find("temperature") != std::string::npos);
    CHECK(message([](auto& p) { p.temperature = NAN; }).find("temperature") != std::string::npos);
    CHECK(message([](auto& p) { p.top_p = 0; }).find("top_p") != std::string::npos);
    CHECK(message([](auto& p) { p.top_p = 1.5f; }).find("top_p") != std::string::npos);
    CHECK(message([](auto& p) { p.top_k = -3; }).find("top_k") != std::string::npos);
    CHECK(message([](auto& p) { p.min_p = 2; }).find("min_p") != std::string::npos);
    CHECK(message([](auto& p) { p.repetition_penalty = 0; }).find("repetition_penalty") != std::string::npos);
    CHECK(message([](auto& p) { p.presence_penalty = 3; }).find("presence_penalty") != std::string::npos);
    CHECK(message([](auto& p) { p.frequency_penalty = -2.5f; }).find("frequency_penalty") != std::string::npos);
    CHECK(message([](auto& p) { p.max_tokens = -1; }).find("max_tokens") != std::string::npos);
    CHECK(message([](auto&) {}).empty());
}
