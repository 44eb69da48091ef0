// The serving framework: server.hpp's logic (request parsing, routing, admission, metrics text) on its own, then
// `infer serve` and `infer route` as processes, over real HTTP on loopback with the built-in demo model. Each server
// gets a free port and is stopped with SIGTERM (which must drain and exit 0). No timing assertions: where a test needs
// a request to still be running, it uses one of 1000 tokens and acts on its first chunk.
#include "serve_support.hpp"

#include <httplib.h>
#include <nlohmann/json.hpp>

#include <csignal>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <thread>
#include <unistd.h>

using nlohmann::json;

namespace {

using namespace serve_test;

// What the engine itself generates for a prompt, greedy: the reference the server's answers are checked against.
std::string engine_text(const std::string& prompt, int max_tokens) {
    static infer::Model model = infer::demo_model();
    infer::ThreadPool pool(1);
    infer::Engine engine(model, pool);
    infer::SamplingParams params;
    params.temperature = 0;
    params.max_tokens = max_tokens;
    int id = engine.add_request(prompt, params);
    while (engine.has_work()) engine.step();
    return engine.take_result(id)->text;
}

const std::vector<std::string> timing_keys = {"http_parse_ms", "tokenize_ms", "queue_ms", "schedule_ms", "prefill_ms",
                                              "decode_ms", "sample_ms", "detokenize_ms", "http_write_ms", "e2e_ms"};

}  // namespace

// ---- server.hpp on its own -------------------------------------------------------------------------------------------

TEST_CASE("parse_request: OpenAI bodies to engine requests, bad fields named") {
    infer::Model model = infer::demo_model();
    infer::Tokenizer tokenizer = infer::tokenizer_for(model);
    serve::RequestContext context{&model, &tokenizer, [](const infer::Json& messages, bool add_generation_prompt, const infer::Json& extra) {
                                      return chat::render(chat::builtin_template("chatml"), messages, add_generation_prompt, extra);
                                  }};
    auto parse = [&](const std::string& body, bool chat = false) {
        return serve::parse_request(infer::Json::parse(body, "test"), chat, context);
    };
    serve::CompletionRequest r = parse(R"({"prompt": "Hi", "max_tokens": 5, "temperature": 0, "stop": "x", "seed": 7})");
    CHECK(r.prompts.front() == tokenizer.encode("Hi"));
    CHECK(r.params.max_tokens == 5);
    CHECK(r.params.temperature == 0);
    CHECK(r.stop == std::vector<std::string>{"x"});
    CHECK(r.params.seed == 7u);
    CHECK(parse(R"({"prompt": "Hi"})").params.max_tokens == 16);  // OpenAI's default for completions
    CHECK(parse(R"({"prompt": [1, 2, 3], "max_completion_tokens": 3, "stream": true, "stream_options": {"include_usage": true}})").include_usage);
    serve::CompletionRequest chat = parse(R"({"messages": [{"role": "user", "content": "Hi"}]})", true);
    CHECK(tokenizer.decode(chat.prompts.front()) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");

    auto error_of = [&](const std::string& body, bool is_chat = false) -> std::pair<std::string, std::string> {
        try {
            parse(body, is_chat);
        } catch (const serve::HttpError& e) {
            CHECK(e.status == 400);
            return {e.param, e.what()};
        }
        return {"", ""};
    };
    CHECK(error_of(R"({"prompt": "Hi", "temperature": -1})").first == "temperature");
    CHECK(error_of(R"({"prompt": "Hi", "top_p": 0})").first == "top_p");
    CHECK(error_of(R"({"prompt": "Hi", "max_tokens": 1.5})").first == "max_tokens");
    CHECK(parse(R"({"prompt": "Hi", "n": 3})").n == 3);
    CHECK(error_of(R"({"prompt": "Hi", "n": 0})").first == "n");
    CHECK(error_of(R"({"prompt": "Hi", "n": 17})").first == "n");
    CHECK(error_of(R"({"prompt": "Hi", "stop": [1]})").first == "stop");
    CHECK(parse(R"({"prompt": "Hi", "logprobs": 2})").params.logprobs == 2);
    CHECK(parse(R"({"prompt": "Hi"})").params.logprobs == -1);
    CHECK(parse(R"({"messages": [{"role": "user", "content": "Hi"}], "logprobs": true, "top_logprobs": 3})", true).params.logprobs == 3);
    CHECK(parse(R"({"messages": [{"role": "user", "content": "Hi"}], "logprobs": true})", true).params.logprobs == 0);
    CHECK(error_of(R"({"prompt": "Hi", "logprobs": 21})").first == "logprobs");
    CHECK(error_of(R"({"prompt": "Hi", "logprobs": true})").first == "logprobs");
    CHECK(error_of(R"({"messages": [{"role": "user", "content": "Hi"}], "top_logprobs": 2})", true).first == "top_logprobs");
    CHECK(error_of(R"({"prompt": [1, 999]})").first == "prompt");
    CHECK(error_of(R"({"max_tokens": 3})").second == "a completion request's body needs a field \"prompt\"");
    CHECK(error_of(R"({"prompt": "Hi", "stream_options": {"include_usage": true}})").first == "stream_options");
    CHECK(error_of(R"({"messages": "Hi"})", true).first == "messages");

    serve::CompletionRequest big = parse(R"({"prompt": [1, 2, 3], "max_tokens": 5000})");
    CHECK_THROWS_WITH_AS(serve::check_fits(big, 1024, 4096),
                         "This model's maximum context length is 1024 tokens. However, you requested 5003 tokens (3 in the "
                         "messages, 5000 in the completion). Please reduce the length of the messages or completion.",
                         serve::HttpError);
}

TEST_CASE("Router: round-robin, least-loaded, and prefix with its fallback when imbalanced") {
    using serve::Candidate;
    std::vector<Candidate> three(3);
    serve::Router rr({.policy = serve::RoutePolicy::RoundRobin});
    CHECK(rr.choose(three, 10) == 0);
    CHECK(rr.choose(three, 10) == 1);
    CHECK(rr.choose(three, 10) == 2);
    CHECK(rr.choose(three, 10) == 0);
    three[1].available = false;  // an ejected upstream is skipped
    const int a = rr.choose(three, 10), b = rr.choose(three, 10);
    CHECK(a != 1);
    CHECK(b != 1);
    CHECK(a != b);

    std::vector<Candidate> loads = {{.requests = 2, .outstanding_tokens = 900}, {.requests = 3, .outstanding_tokens = 100},
                                    {.requests = 1, .outstanding_tokens = 500}};
    serve::Router least({.policy = serve::RoutePolicy::LeastLoaded});
    CHECK(least.choose(loads, 10) == 1);  // outstanding tokens, not request count

    serve::Router prefix({.policy = serve::RoutePolicy::Prefix});
    loads[2].prefix_match = 64;
    CHECK(prefix.choose(loads, 80) == 2);  // 64 of 80 cached there
    CHECK(prefix.choose(loads, 200) == 1); // 64 of 200 is under the threshold: least-loaded
    loads[2].requests = 40;                // 40 vs 2 requests: imbalanced, so least-loaded despite the cache
    CHECK(prefix.choose(loads, 80) == 1);
    std::vector<Candidate> none(2, Candidate{.available = false});
    CHECK(prefix.choose(none, 10) == -1);

    serve::PrefixRecord record;
    record.add("You are a helpful assistant. Question: 1");
    CHECK(record.longest_match("You are a helpful assistant. Question: 2") == 39);
}

TEST_CASE("Admission and the metrics text") {
    serve::AdmissionLimits limits{.max_waiting_requests = 1, .max_waiting_tokens = 100};
    CHECK(serve::admit(limits, 0, 0, 50));
    CHECK_FALSE(serve::admit(limits, 1, 0, 50));   // a request already waits
    CHECK_FALSE(serve::admit(limits, 0, 60, 50));  // too many waiting tokens
    serve::Metrics m;
    m.add("infer:prompt_tokens_total", "", 5);
    m.observe("infer:time_to_first_token_seconds", 0.03);
    auto samples = serve::parse_prometheus(m.render({{"infer:num_requests_running", {{"instance=\"0\"", 2}}}}));
    CHECK(samples.at("infer:prompt_tokens_total") == 5);
    CHECK(samples.at("infer:num_requests_running{instance=\"0\"}") == 2);
    CHECK(samples.at("infer:time_to_first_token_seconds_bucket{le=\"0.02\"}") == 0);
    CHECK(samples.at("infer:time_to_first_token_seconds_bucket{le=\"0.04\"}") == 1);
    CHECK(samples.at("infer:time_to_first_token_seconds_count") == 1);
    CHECK(test::error_of([] { serve::parse_prometheus("infer:x{a=\"1\"} abc\n"); }) == "metrics line 1: \"abc\" is not a number");
    m.set_model_name("my \"model\"");  // every series, histograms included, then names the model (quoted as the format says)
    auto labelled = serve::parse_prometheus(m.render({{"infer:num_requests_running", {{"instance=\"0\"", 2}}}}));
    CHECK(labelled.at("infer:prompt_tokens_total{model_name=\"my \\\"model\\\"\"}") == 5);
    CHECK(labelled.at("infer:num_requests_running{model_name=\"my \\\"model\\\"\",instance=\"0\"}") == 2);
    CHECK(labelled.at("infer:time_to_first_token_seconds_bucket{model_name=\"my \\\"model\\\"\",le=\"0.04\"}") == 1);
    CHECK(labelled.at("infer:time_to_first_token_seconds_count{model_name=\"my \\\"model\\\"\"}") == 1);
    CHECK(client::without_model_label("infer:x{model_name=\"a\\\"b\",instance=\"0\"}") == "infer:x{instance=\"0\"}");
    CHECK(client::without_model_label("infer:x{model_name=\"a\"}") == "infer:x");
    CHECK(serve::error_body(429, "full") == R"({"error":{"message":"full","type":"rate_limit_error","param":null,"code":429}})");
}

// ---- infer serve over HTTP ------------------------------------------------------------------------------------------

TEST_CASE("infer serve: every endpoint, streaming and not, answers as OpenAI's") {
    Server server;
    const int port = server.port();
    httplib::Client client("127.0.0.1", port);
    auto health = client.Get("/health");
    REQUIRE(health);
    CHECK(health->status == 200);
    auto models = client.Get("/v1/models");
    REQUIRE(models);
    CHECK(json::parse(models->body)["data"][0]["id"] == "infer-demo");

    const std::string expected = engine_text("Once upon a time", 12);
    auto plain = post(port, "/v1/completions", R"({"model": "infer-demo", "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0})");
    REQUIRE(plain);
    REQUIRE(plain->status == 200);
    json body = json::parse(plain->body);
    CHECK(body["object"] == "text_completion");
    CHECK(body["choices"][0]["text"] == expected);
    CHECK(body["choices"][0]["finish_reason"] == "length");
    CHECK(body["usage"]["completion_tokens"] == 12);
    CHECK(body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"].get<int>() + 12);
    for (const std::string& key : timing_keys) CHECK(body["infer_timing"].contains(key));
    CHECK(body["infer_timing"]["e2e_ms"].get<double>() > 0);

    Streamed streamed = stream(port, "/v1/completions",
                               R"({"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "stream": true,
                                   "stream_options": {"include_usage": true}})");
    CHECK(streamed.status == 200);
    REQUIRE(streamed.events.size() >= 3);
    CHECK(streamed.events.back() == "[DONE]");
    CHECK(streamed.text == expected);
    CHECK(streamed.usage["completion_tokens"] == 12);
    CHECK(json::parse(streamed.events[streamed.events.size() - 2])["choices"].empty());  // the usage chunk
    CHECK(streamed.last_choice_chunk["choices"][0]["finish_reason"] == "length");
    for (const std::string& key : timing_keys) CHECK(streamed.timing.contains(key));

    // Without include_usage: no usage anywhere, the timing rides on the finish_reason chunk.
    Streamed bare = stream(port, "/v1/completions", R"({"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0, "stream": true})");
    CHECK(bare.usage.is_null());
    CHECK(bare.last_choice_chunk.contains("infer_timing"));
    CHECK(bare.text == engine_text("Once upon a time", 4));

    auto chat = post(port, "/v1/chat/completions", R"({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "seed": 1})");
    REQUIRE(chat);
    REQUIRE(chat->status == 200);
    json reply = json::parse(chat->body);
    CHECK(reply["object"] == "chat.completion");
    CHECK(reply["choices"][0]["message"]["role"] == "assistant");
    CHECK(reply["usage"]["completion_tokens"] == 6);
    Streamed chat_stream = stream(port, "/v1/chat/completions",
                                  R"({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "seed": 1, "stream": true})");
    CHECK(chat_stream.events.back() == "[DONE]");
    json first = json::parse(chat_stream.events.front());
    CHECK(first["object"] == "chat.completion.chunk");
    CHECK(first["choices"][0]["delta"]["role"] == "assistant");
    CHECK(chat_stream.text == reply["choices"][0]["message"]["content"]);  // same seed, same reply

    // The metrics moved with all that, and read as Prometheus text.
    auto samples = metrics(port);
    CHECK(metric(samples, "infer:http_requests_total{endpoint=\"/v1/completions\",status=\"200\"}") == 3);
    CHECK(metric(samples, "infer:http_requests_total{endpoint=\"/v1/chat/completions\",status=\"200\"}") == 2);
    CHECK(metric(samples, "infer:generation_tokens_total") == 12 + 12 + 4 + 6 + 6);
    CHECK(metric(samples, "infer:request_success_total{finished_reason=\"length\"}") == 5);
    CHECK(metric(samples, "infer:time_to_first_token_seconds_count") == 5);
    CHECK(metric(samples, "infer:e2e_request_latency_seconds_count") == 5);
    CHECK(metric(samples, "infer:request_layer_seconds_total{layer=\"decode\"}") > 0);
    CHECK(metric(samples, "infer:kv_cache_used_blocks{instance=\"0\"}") == 0);
    CHECK(metric(samples, "infer:prefix_cache_hits_total{instance=\"0\"}") > 0);  // the same prompt came back
    CHECK(server.stop() == 0);
}

TEST_CASE("infer serve: logprobs as OpenAI's completions and chat APIs shape them, streamed and not") {
    Server server;
    const int port = server.port();
    // The engine's own figures for the same greedy request (test_engine checks them against llama.cpp's logits).
    static infer::Model model = infer::demo_model();
    infer::ThreadPool pool(1);
    infer::Engine engine(model, pool);
    infer::SamplingParams params;
    params.temperature = 0;
    params.max_tokens = 6;
    params.logprobs = 3;
    int id = engine.add_request("Once upon a time", params);
    while (engine.has_work()) engine.step();
    const std::vector<infer::TokenLogprob> expected = engine.take_result(id)->logprobs;
    REQUIRE(expected.size() == 6);

    auto plain = post(port, "/v1/completions", R"({"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0, "logprobs": 3})");
    REQUIRE(plain);
    REQUIRE(plain->status == 200);
    json lp = json::parse(plain->body)["choices"][0]["logprobs"];
    REQUIRE(lp["tokens"].size() == 6);
    REQUIRE(lp["token_logprobs"].size() == 6);
    REQUIRE(lp["top_logprobs"].size() == 6);
    REQUIRE(lp["text_offset"].size() == 6);
    CHECK(lp["text_offset"][0] == 0);
    for (size_t i = 0; i < 6; ++i) {
        CHECK(lp["token_logprobs"][i].get<double>() == doctest::Approx(expected[i].logprob).epsilon(1e-5));
        CHECK(lp["top_logprobs"][i].size() >= 3);  // the 3 likeliest (greedy: the sampled one is among them)
    }
    CHECK(json::parse(post(port, "/v1/completions", R"({"prompt": "Hi", "max_tokens": 2})")->body)["choices"][0]["logprobs"].is_null());

    Streamed chat = stream(port, "/v1/chat/completions",
                           R"({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "temperature": 0, "ignore_eos": true,
                               "stream": true, "logprobs": true, "top_logprobs": 2})");
    CHECK(chat.status == 200);
    size_t entries = 0;
    for (const std::string& event : chat.events) {
        if (event == "[DONE]") continue;
        json chunk = json::parse(event);
        if (chunk["choices"].empty()) continue;
        const json& logprobs = chunk["choices"][0]["logprobs"];
        if (logprobs.is_null()) continue;
        for (const json& entry : logprobs["content"]) {
            CHECK(entry["logprob"].get<double>() <= 0);
            CHECK(entry["top_logprobs"].size() == 2);
            CHECK(entry["top_logprobs"][0]["logprob"].get<double>() == doctest::Approx(entry["logprob"].get<double>()));
            CHECK(entry["bytes"].is_array());
            ++entries;
        }
    }
    CHECK(entries == 5);
}

TEST_CASE("infer serve: n choices, each its own sample, streamed and not") {
    Server server;
    const int port = server.port();
    const std::string body = R"({"prompt": "Once upon a time", "max_tokens": 8, "temperature": 1.0, "seed": 5, "ignore_eos": true, "n": 3)";
    auto plain = post(port, "/v1/completions", body + "}");
    REQUIRE(plain);
    REQUIRE(plain->status == 200);
    json response = json::parse(plain->body);
    REQUIRE(response["choices"].size() == 3);
    std::vector<std::string> texts;
    for (int i = 0; i < 3; ++i) {
        CHECK(response["choices"][i]["index"] == i);
        CHECK(response["choices"][i]["finish_reason"] == "length");
        texts.push_back(response["choices"][i]["text"]);
    }
    CHECK(response["usage"]["completion_tokens"] == 24);  // the prompt counts once, the choices add up
    CHECK(response["usage"]["total_tokens"] == response["usage"]["prompt_tokens"].get<int>() + 24);
    CHECK((texts[0] != texts[1] || texts[1] != texts[2]));  // seeds 5, 6, 7: not one sample three times
    // Choice i is the request with seed 5 + i, alone.
    auto second = post(port, "/v1/completions", R"({"prompt": "Once upon a time", "max_tokens": 8, "temperature": 1.0, "seed": 6, "ignore_eos": true})");
    CHECK(json::parse(second->body)["choices"][0]["text"] == texts[1]);

    // Streamed: each chunk names its choice; each choice's text and finish_reason arrive, then the usage.
    Streamed streamed = stream(port, "/v1/completions", body + R"(, "stream": true, "stream_options": {"include_usage": true}})");
    CHECK(streamed.status == 200);
    std::map<int, std::string> by_index;
    std::map<int, std::string> finish;
    for (const std::string& event : streamed.events) {
        if (event == "[DONE]") continue;
        json chunk = json::parse(event);
        for (const json& choice : chunk["choices"]) {
            by_index[choice["index"].get<int>()] += choice["text"].get<std::string>();
            if (!choice["finish_reason"].is_null()) finish[choice["index"].get<int>()] = choice["finish_reason"];
        }
    }
    for (int i = 0; i < 3; ++i) {
        CHECK(by_index[i] == texts[i]);
        CHECK(finish[i] == "length");
    }
    CHECK(streamed.usage["completion_tokens"] == 24);
}

TEST_CASE("infer serve: every error status with OpenAI's error object") {
    Server server({"--api-key", "sekret", "--max-body", "2000"});
    const int port = server.port();
    const httplib::Headers auth = {{"Authorization", "Bearer sekret"}};
    auto error_of = [](const httplib::Result& answer) {
        REQUIRE(answer);
        return json::parse(answer->body)["error"];
    };
    auto missing = post(port, "/v1/completions", R"({"prompt": "Hi"})");
    CHECK(missing->status == 401);
    CHECK(error_of(missing)["type"] == "authentication_error");
    auto wrong = post(port, "/v1/completions", R"({"prompt": "Hi"})", {{"Authorization", "Bearer nope"}});
    CHECK(wrong->status == 401);
    httplib::Client client("127.0.0.1", port);
    CHECK(client.Get("/v1/models")->status == 401);
    CHECK(client.Get("/v1/models", auth)->status == 200);
    CHECK(client.Get("/health")->status == 200);  // health and metrics stay open, as vLLM's

    auto malformed = post(port, "/v1/completions", "{\"prompt\": ", auth);
    CHECK(malformed->status == 400);
    CHECK(error_of(malformed)["message"].get<std::string>().rfind("malformed JSON", 0) == 0);
    auto invalid = post(port, "/v1/completions", R"({"prompt": "Hi", "top_p": 2})", auth);
    CHECK(invalid->status == 400);
    CHECK(error_of(invalid)["param"] == "top_p");
    CHECK(error_of(invalid)["type"] == "invalid_request_error");
    auto too_long = post(port, "/v1/completions", R"({"prompt": "Hi", "max_tokens": 5000})", auth);
    CHECK(too_long->status == 400);
    CHECK(error_of(too_long)["param"] == "max_tokens");
    auto no_template_needed = post(port, "/v1/chat/completions", R"({"messages": []})", auth);
    CHECK(no_template_needed->status == 400);

    auto no_route = client.Get("/v1/embeddings", auth);
    CHECK(no_route->status == 404);
    CHECK(json::parse(no_route->body)["error"]["type"] == "not_found_error");
    auto no_model = post(port, "/v1/completions", R"({"model": "gpt-4", "prompt": "Hi"})", auth);
    CHECK(no_model->status == 404);
    CHECK(error_of(no_model)["message"] == "The model `gpt-4` does not exist.");

    auto huge = post(port, "/v1/completions", R"({"prompt": ")" + std::string(3000, 'a') + "\"}", auth);
    REQUIRE(huge);
    CHECK(huge->status == 413);

    auto samples = metrics(port);
    CHECK(metric(samples, "infer:http_requests_total{endpoint=\"/v1/completions\",status=\"401\"}") == 2);
    CHECK(metric(samples, "infer:http_requests_total{endpoint=\"/v1/completions\",status=\"400\"}") == 3);
    CHECK(metric(samples, "infer:http_requests_total{endpoint=\"/v1/completions\",status=\"404\"}") == 1);
    CHECK(server.stop() == 0);
}

TEST_CASE("infer serve: a burst against a queue of 1 gets 429s, and every accepted request completes") {
    Server server({"--max-queue", "1", "--max-seqs", "1"});
    const int port = server.port();
    // One long request holds the only running slot; the burst arrives while it streams.
    std::atomic<bool> started{false};
    std::vector<int> statuses(8, 0);
    std::vector<json> bodies(8);
    std::vector<std::string> retry_after(8);
    Streamed long_one;
    std::thread holder([&] {
        long_one = stream(port, "/v1/completions", R"({"prompt": "x", "max_tokens": 1000, "stream": true})", [&](const std::string&) {
            started = true;
            return true;
        });
    });
    while (!started) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    std::vector<std::thread> burst;
    for (int i = 0; i < 8; ++i)
        burst.emplace_back([&, i] {
            auto answer = post(port, "/v1/completions", R"({"prompt": "burst", "max_tokens": 16})");
            if (!answer) return;
            statuses[i] = answer->status;
            bodies[i] = json::parse(answer->body);
            retry_after[i] = answer->get_header_value("Retry-After");
        });
    for (std::thread& t : burst) t.join();
    holder.join();
    int accepted = 0, refused = 0;
    for (int i = 0; i < 8; ++i) {
        if (statuses[i] == 200) {
            ++accepted;
            CHECK(bodies[i]["usage"]["completion_tokens"] == 16);  // ran to its end
        } else {
            CHECK(statuses[i] == 429);
            CHECK(bodies[i]["error"]["type"] == "rate_limit_error");
            CHECK(retry_after[i] == "1");
            ++refused;
        }
    }
    CHECK(refused >= 1);
    CHECK(accepted + refused == 8);
    CHECK(long_one.events.back() == "[DONE]");
    CHECK(long_one.usage.is_null());
    auto samples = metrics(port);
    CHECK(metric(samples, "infer:http_requests_total{endpoint=\"/v1/completions\",status=\"429\"}") == refused);
    CHECK(metric(samples, "infer:request_success_total{finished_reason=\"length\"}") == accepted + 1);
    MESSAGE("burst of 8 against --max-queue 1: " << accepted << " accepted, " << refused << " refused with 429");
    CHECK(server.stop() == 0);
}

TEST_CASE("infer serve: a burst of 200 clients gets 200 or 429, never a reset, and every accepted request completes") {
    Server server({"--max-seqs", "2", "--max-queue", "4"});
    const int port = server.port();
    constexpr int clients = 200;
    std::vector<int> statuses(clients, 0), completions(clients, -1);
    std::vector<std::string> failures(clients);
    std::atomic<int> ready{0};
    std::vector<std::thread> burst;
    for (int i = 0; i < clients; ++i)
        burst.emplace_back([&, i] {
            ++ready;
            while (ready < clients) std::this_thread::yield();  // all connect at once
            const bool streaming = i % 2 == 1;
            const std::string body = std::string(R"({"prompt": "Once upon a time", "max_tokens": 8, "stream": )") +
                                     (streaming ? "true" : "false") + "}";
            if (streaming) {
                Streamed s = stream(port, "/v1/completions", body);
                statuses[i] = s.status;
                if (s.status == 200) completions[i] = s.events.empty() || s.events.back() != "[DONE]" ? 0 : 8;
                if (s.status == 0) failures[i] = "no answer";
                return;
            }
            auto answer = post(port, "/v1/completions", body);
            if (!answer) {
                failures[i] = httplib::to_string(answer.error());
                return;
            }
            statuses[i] = answer->status;
            if (answer->status == 200) completions[i] = json::parse(answer->body)["usage"]["completion_tokens"].get<int>();
        });
    for (std::thread& t : burst) t.join();
    int accepted = 0, refused = 0, lost = 0;
    for (int i = 0; i < clients; ++i) {
        INFO("client " << i << ": " << failures[i]);
        CHECK((statuses[i] == 200 || statuses[i] == 429));
        if (statuses[i] == 200) {
            ++accepted;
            CHECK(completions[i] == 8);  // every accepted request ran to its end
        } else if (statuses[i] == 429) {
            ++refused;
        } else {
            ++lost;
        }
    }
    CHECK(lost == 0);
    CHECK(accepted >= 6);  // the two running and four queued slots were filled
    MESSAGE("burst of " << clients << " against --max-seqs 2 --max-queue 4: " << accepted << " × 200, " << refused
                        << " × 429, " << lost << " connections reset or unanswered");

    // 200 concurrent health checks: all answered.
    std::atomic<int> healthy{0};
    std::vector<std::thread> checks;
    for (int i = 0; i < clients; ++i)
        checks.emplace_back([&] {
            httplib::Client client("127.0.0.1", port);
            client.set_read_timeout(60);
            if (auto answer = client.Get("/health"); answer && answer->status == 200) ++healthy;
        });
    for (std::thread& t : checks) t.join();
    CHECK(healthy == clients);
    CHECK(server.stop() == 0);
}

TEST_CASE("infer serve: hostile requests get a 4xx that names the field, and /metrics stays a fixed set of series") {
    Server server;
    const int port = server.port();
    auto error_of = [](const httplib::Result& answer) {
        REQUIRE(answer);
        return json::parse(answer->body)["error"];  // parse() also proves the body is valid UTF-8
    };
    // max_tokens and n are bounded before any arithmetic: 2^31 - 1 tokens times 16 choices once ran past the context.
    auto huge_max = post(port, "/v1/completions", R"({"prompt": "Hi", "max_tokens": 2147483647, "n": 16})");
    CHECK(huge_max->status == 400);
    CHECK(error_of(huge_max)["param"] == "max_tokens");
    CHECK(error_of(huge_max)["message"].get<std::string>().find("2147483647") != std::string::npos);
    auto many = post(port, "/v1/completions", R"({"prompt": "Hi", "n": 17})");
    CHECK(many->status == 400);
    CHECK(error_of(many)["param"] == "n");
    // A JSON body over 8 KB sent as a form (curl -d's default content type) is read as JSON, not refused with a 413.
    httplib::Client client("127.0.0.1", port);
    const std::string long_prompt = R"({"prompt": "Hi", "max_tokens": 1)" + std::string(9000, ' ') + "}";
    auto form = client.Post("/v1/completions", long_prompt, "application/x-www-form-urlencoded");
    REQUIRE(form);
    CHECK(form->status == 200);
    auto multipart = client.Post("/v1/completions", httplib::MultipartFormDataItems{{"prompt", "Hi", "", ""}});
    REQUIRE(multipart);
    CHECK(multipart->status == 415);
    // Invalid UTF-8 echoed in an error comes back as U+FFFD, inside valid JSON.
    auto bad_model = post(port, "/v1/completions", "{\"model\": \"m\xff\xfe\", \"prompt\": \"Hi\"}");
    CHECK(bad_model->status == 404);
    CHECK(error_of(bad_model)["message"].get<std::string>().find("\xEF\xBF\xBD") != std::string::npos);
    // Unknown paths share one label: neither a forged series nor one series per path.
    for (int i = 0; i < 20; ++i) CHECK(client.Get(("/nope-" + std::to_string(i)).c_str())->status == 404);
    CHECK(client.Get("/x%22%7Dinjected%7B")->status == 404);
    httplib::Client raw("127.0.0.1", port);
    auto text = raw.Get("/metrics");
    REQUIRE(text);
    CHECK(text->body.find("nope-") == std::string::npos);
    CHECK(text->body.find("injected") == std::string::npos);
    CHECK(metric(serve::parse_prometheus(text->body), "infer:http_requests_total{model_name=\"infer-demo\",endpoint=\"other\",status=\"404\"}") == 21);
    CHECK(server.stop() == 0);
}

TEST_CASE("infer serve: a model file truncated while served: --no-mmap keeps serving; mapped, the server says why it stops") {
    REQUIRE_SHARED_OR_SKIP();
    test::TempDir dir("truncated");
    const std::filesystem::path original = test::shared_dir() / "models/stories260K/stories260K.gguf";
    for (const bool mapped : {false, true}) {
        const std::filesystem::path copy = dir / (mapped ? "mapped.gguf" : "read.gguf");
        std::filesystem::copy_file(original, copy);
        std::vector<std::string> args = {"-m", copy.string()};
        if (!mapped) args.push_back("--no-mmap");
        Server server(args);
        const std::string request = R"({"prompt": "Once upon a time", "max_tokens": 4})";
        REQUIRE(post(server.port(), "/v1/completions", request)->status == 200);
        std::filesystem::resize_file(copy, 0);  // rewritten in place, as a careless download or copy would
        auto after = post(server.port(), "/v1/completions", request);
        if (!mapped) {
            REQUIRE(after);
            CHECK(after->status == 200);  // the weights live in memory: the file no longer matters
            CHECK(server.stop() == 0);
        } else {
            CHECK(server.stop(SIGKILL) != 0);  // it has already exited, or is killed now
            CHECK(server.log().find("the model file changed or was truncated") != std::string::npos);
        }
    }
}

TEST_CASE("infer serve: a client that disconnects cancels its request and frees its blocks") {
    Server server({"--max-seqs", "1"});
    const int port = server.port();
    double blocks_while_running = -1;
    Streamed cut = stream(port, "/v1/completions", R"({"prompt": "Once upon a time", "max_tokens": 1000, "stream": true})",
                          [&](const std::string&) {
                              blocks_while_running = metric(metrics(port), "infer:kv_cache_used_blocks{instance=\"0\"}");
                              return false;  // hang up after the first chunk
                          });
    CHECK(blocks_while_running > 0);
    CHECK(wait_for_metric(port, "infer:request_aborted_total{finished_reason=\"cancelled\"}", 1));
    CHECK(wait_for_metric(port, "infer:kv_cache_used_blocks{instance=\"0\"}", 0));
    CHECK(metric(metrics(port), "infer:http_requests_total{endpoint=\"/v1/completions\",status=\"499\"}") == 1);

    // A queued request whose client gives up is cancelled before it ever runs.
    std::atomic<bool> started{false};
    std::thread holder([&] {
        stream(port, "/v1/completions", R"({"prompt": "x", "max_tokens": 1000, "stream": true})", [&](const std::string&) {
            started = true;
            return true;
        });
    });
    while (!started) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    {
        httplib::Client impatient("127.0.0.1", port);
        impatient.set_read_timeout(0, 50000);  // 50 ms, then it hangs up
        auto answer = impatient.Post("/v1/completions", R"({"prompt": "queued", "max_tokens": 8})", "application/json");
        CHECK(!answer);
    }
    holder.join();
    CHECK(wait_for_metric(port, "infer:request_aborted_total{finished_reason=\"cancelled\"}", 2));
    CHECK(wait_for_metric(port, "infer:kv_cache_used_blocks{instance=\"0\"}", 0));
    CHECK(server.stop() == 0);
}

TEST_CASE("infer serve: SIGTERM drains (503 to newcomers, running requests finish) and exits 0") {
    Server server({"--max-seqs", "1"});
    const int port = server.port();
    std::atomic<bool> started{false};
    Streamed running;
    std::thread holder([&] {
        running = stream(port, "/v1/completions", R"({"prompt": "x", "max_tokens": 1000, "stream": true, "stream_options": {"include_usage": true}})",
                         [&](const std::string&) {
                             started = true;
                             return true;
                         });
    });
    while (!started) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    std::thread stopper([&] { CHECK(server.stop(SIGTERM) == 0); });
    CHECK(wait_for_health(port, 503));
    auto refused = post(port, "/v1/completions", R"({"prompt": "late"})");
    if (refused) CHECK(refused->status == 503);  // (or the port already closed: the drain finished first)
    holder.join();
    stopper.join();
    CHECK(running.events.back() == "[DONE]");
    CHECK(running.usage["completion_tokens"] == 1000);
}

TEST_CASE("infer serve --instances 3: the prefix policy sends same-prefix requests to one instance") {
    const std::string shared = "You are a storyteller. Tell a short story about a dragon who learns to bake bread, "
                               "with a happy ending and a moral about patience. Story number ";
    for (std::string policy : {"prefix", "round-robin"}) {
        Server server({"--instances", "3", "--route", policy});
        for (int i = 0; i < 6; ++i) {
            auto answer = post(server.port(), "/v1/completions",
                               R"({"prompt": ")" + shared + std::to_string(i) + R"(", "max_tokens": 2, "temperature": 0})");
            REQUIRE(answer);
            CHECK(answer->status == 200);
        }
        auto samples = metrics(server.port());
        std::vector<double> routed;
        double hits = 0;
        for (int i = 0; i < 3; ++i) {
            routed.push_back(metric(samples, "infer:instance_requests_total{instance=\"" + std::to_string(i) + "\"}"));
            hits += metric(samples, "infer:prefix_cache_hits_total{instance=\"" + std::to_string(i) + "\"}");
        }
        MESSAGE(policy << ": requests per instance " << routed[0] << ", " << routed[1] << ", " << routed[2]
                       << "; prefix-cache hits " << hits << " tokens");
        if (policy == "prefix") {
            CHECK(*std::max_element(routed.begin(), routed.end()) == 6);
            CHECK(hits >= 5 * 16);  // each later request found at least one block of the shared prefix
        } else {
            CHECK(routed == std::vector<double>{2, 2, 2});
        }
        CHECK(server.stop() == 0);
    }
}

// ---- infer route ----------------------------------------------------------------------------------------------------

TEST_CASE("infer route: streams pass through; a killed upstream is ejected, and readmitted when it returns") {
    auto first = std::make_unique<Server>();
    Server second;
    const int port = free_port();
    const int first_port = first->port();
    Process proxy({infer_bin(), "route", "--port", std::to_string(port), "--upstream", first->url(), "--upstream",
                   second.url(), "--health-interval", "0.1"},
                  "route");
    REQUIRE_MESSAGE(wait_for_health(port), proxy.log());

    const std::string request = R"({"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "stream": true})";
    Streamed direct = stream(second.port(), "/v1/completions", request);
    for (int i = 0; i < 2; ++i) {  // round-robin: once through each upstream
        Streamed through = stream(port, "/v1/completions", request);
        CHECK(through.status == 200);
        CHECK(through.events.size() == direct.events.size());
        CHECK(through.events.back() == "[DONE]");
        CHECK(through.text == direct.text);
    }
    auto plain = post(port, "/v1/chat/completions", R"({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})");
    REQUIRE(plain);
    CHECK(json::parse(plain->body)["usage"]["completion_tokens"] == 3);
    auto bad = post(port, "/v1/completions", R"({"prompt": "Hi", "top_p": 5})");
    CHECK(bad->status == 400);  // the upstream's error passes through as it is
    auto tokens = post(port, "/tokenize", R"({"prompt": "Once upon a time"})");  // the other endpoints pass through too
    REQUIRE(tokens);
    CHECK(tokens->status == 200);
    CHECK(json::parse(tokens->body)["count"].get<int>() > 0);
    httplib::Client proxied("127.0.0.1", port);
    auto model = proxied.Get("/v1/models/infer-demo");
    REQUIRE(model);
    CHECK(json::parse(model->body)["id"] == "infer-demo");

    const std::string healthy_first = "infer:upstream_healthy{upstream=\"" + first->url() + "\"}";
    CHECK(metric(metrics(port), healthy_first) == 1);
    first->stop(SIGKILL);
    CHECK(wait_for_metric(port, healthy_first, 0));
    for (int i = 0; i < 4; ++i) {
        auto answer = post(port, "/v1/completions", R"({"prompt": "Hi", "max_tokens": 2})");
        REQUIRE(answer);
        CHECK(answer->status == 200);
    }
    first = std::make_unique<Server>(std::vector<std::string>{}, first_port);  // back on its port
    CHECK(wait_for_metric(port, healthy_first, 1));
    CHECK(proxy.stop() == 0);
    CHECK(proxy.log().find("ejected") != std::string::npos);
    CHECK(proxy.log().find("readmitted") != std::string::npos);
}

// A stand-in upstream that misbehaves on purpose: healthy, then it dies mid-answer or never answers.
class BrokenUpstream {
public:
    BrokenUpstream() : port_(free_port()) {
        http_.Get("/health", [](const httplib::Request&, httplib::Response& res) { res.set_content("{\"status\":\"ok\"}", "application/json"); });
        http_.Post("/v1/completions", [](const httplib::Request& req, httplib::Response& res) {
            json body = json::parse(req.body);
            const std::string mode = body.value("prompt", "");
            if (mode == "bad request") {  // an upstream's own error: passed through as sent
                res.status = 400;
                return res.set_content(R"({"error":{"message":"upstream says no","type":"invalid_request_error","param":"prompt","code":400}})",
                                       "application/json");
            }
            if (mode == "slow") {
                std::this_thread::sleep_for(std::chrono::seconds(3));
                return res.set_content("{}", "application/json");
            }
            if (body.value("stream", false)) {  // one event, then the connection drops
                return res.set_chunked_content_provider("text/event-stream", [](size_t, httplib::DataSink& sink) {
                    const std::string event = "data: {\"choices\":[{\"index\":0,\"text\":\"Once\"}]}\n\n";
                    sink.write(event.data(), event.size());
                    return false;
                });
            }
            res.set_content_provider(1000, "application/json", [](size_t, size_t, httplib::DataSink& sink) {
                sink.write("{\"choices\":", 11);  // 11 of the 1000 bytes promised
                return false;
            });
        });
        REQUIRE(http_.bind_to_port("127.0.0.1", port_));
        thread_ = std::thread([this] { http_.listen_after_bind(); });
    }
    ~BrokenUpstream() {
        http_.stop();
        thread_.join();
    }
    std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }

private:
    int port_;
    httplib::Server http_;
    std::thread thread_;
};

TEST_CASE("infer route: an upstream that fails is a 502, 504 or an SSE error event, never a truncated 200; its errors pass through") {
    BrokenUpstream upstream;
    const int port = free_port();
    Process proxy({infer_bin(), "route", "--port", std::to_string(port), "--upstream", upstream.url(), "--upstream-timeout", "1"},
                  "route");
    REQUIRE_MESSAGE(wait_for_health(port), proxy.log());
    auto passed = post(port, "/v1/completions", R"({"prompt": "bad request"})");
    REQUIRE(passed);
    CHECK(passed->status == 400);
    CHECK(json::parse(passed->body)["error"]["message"] == "upstream says no");
    auto cut = post(port, "/v1/completions", R"({"prompt": "cut"})");
    REQUIRE(cut);
    CHECK(cut->status == 502);
    CHECK(json::parse(cut->body)["error"]["message"].get<std::string>().find("failed mid-response") != std::string::npos);
    auto slow = post(port, "/v1/completions", R"({"prompt": "slow"})");
    REQUIRE(slow);
    CHECK(slow->status == 504);
    CHECK(json::parse(slow->body)["error"]["message"].get<std::string>().find("--upstream-timeout") != std::string::npos);
    Streamed streamed = stream(port, "/v1/completions", R"({"prompt": "cut", "stream": true})");
    CHECK(streamed.status == 200);
    REQUIRE(streamed.events.size() == 2);
    CHECK(streamed.text == "Once");
    CHECK(json::parse(streamed.events.back())["error"]["message"].get<std::string>().find("failed mid-stream") != std::string::npos);
    CHECK(std::find(streamed.events.begin(), streamed.events.end(), "[DONE]") == streamed.events.end());
    MESSAGE("upstream killed mid-stream, as the client saw it: " << streamed.events.front() << " | " << streamed.events.back());
    CHECK(proxy.stop() == 0);
}

// ---- nginx in front (chapter 09's configuration) --------------------------------------------------------------------

TEST_CASE("nginx least_conn in front of two infer serve processes (when nginx is installed)") {
    std::string nginx;
    for (const char* path : {"/usr/sbin/nginx", "/usr/bin/nginx", "/usr/local/sbin/nginx"})
        if (std::filesystem::exists(path)) nginx = path;
    if (nginx.empty()) {
        MESSAGE("SKIPPED: nginx is not installed (Debian: apt-get install nginx)");
        return;
    }
    Server a, b;
    const int port = free_port();
    test::TempDir prefix("nginx");
    std::string config = infer::read_text_file(std::filesystem::path(__FILE__).parent_path() / "nginx" / "infer.conf");
    auto replace = [&](const std::string& from, const std::string& to) {
        for (size_t at; (at = config.find(from)) != std::string::npos;) config.replace(at, from.size(), to);
    };
    replace("127.0.0.1:8081", "127.0.0.1:" + std::to_string(a.port()));
    replace("127.0.0.1:8082", "127.0.0.1:" + std::to_string(b.port()));
    replace("listen 127.0.0.1:8080", "listen 127.0.0.1:" + std::to_string(port));
    // Run unprivileged in the foreground, with every file nginx writes inside the temporary folder.
    const std::string p = prefix.path().string();
    std::string main_config = "daemon off;\nworker_processes 1;\npid " + p + "/nginx.pid;\nerror_log " + p +
                              "/error.log;\nevents { worker_connections 256; }\nhttp {\n  access_log off;\n  client_body_temp_path " +
                              p + "/body;\n  proxy_temp_path " + p + "/proxy;\n  fastcgi_temp_path " + p + "/fastcgi;\n  uwsgi_temp_path " +
                              p + "/uwsgi;\n  scgi_temp_path " + p + "/scgi;\n" + config + "\n}\n";
    test::write_file(prefix / "nginx.conf", main_config);
    Process proxy({nginx, "-p", p, "-c", p + "/nginx.conf"}, "nginx");
    if (!wait_for_health(port)) {
        MESSAGE("SKIPPED: nginx did not start here: " << proxy.log() << infer::read_text_file(prefix / "error.log"));
        return;
    }
    Streamed through = stream(port, "/v1/completions", R"({"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "stream": true})");
    CHECK(through.events.back() == "[DONE]");
    CHECK(through.text == engine_text("Once upon a time", 8));
    for (int i = 0; i < 4; ++i) CHECK(post(port, "/v1/completions", R"({"prompt": "Hi", "max_tokens": 2})")->status == 200);
    const double on_a = metric(metrics(a.port()), "infer:instance_requests_total{instance=\"0\"}");
    const double on_b = metric(metrics(b.port()), "infer:instance_requests_total{instance=\"0\"}");
    CHECK(on_a + on_b == 5);
    CHECK(on_a >= 1);  // least_conn with no connections open spreads them (round-robin among equals)
    CHECK(on_b >= 1);
    proxy.stop(SIGQUIT);
}

TEST_CASE("infer serve --spec ngram: the same text as without, and /metrics counts the guesses drafted and kept") {
    Server server({"--spec", "ngram", "--spec-k", "4"});
    const int port = server.port();
    const std::string expected = engine_text("Once upon a time", 48);
    auto plain = post(port, "/v1/completions", R"({"prompt": "Once upon a time", "max_tokens": 48, "temperature": 0})");
    REQUIRE(plain);
    REQUIRE(plain->status == 200);
    CHECK(json::parse(plain->body)["choices"][0]["text"] == expected);
    auto samples = metrics(port);
    const double drafted = metric(samples, "infer:spec_decode_num_draft_tokens_total{instance=\"0\"}");
    const double accepted = metric(samples, "infer:spec_decode_num_accepted_tokens_total{instance=\"0\"}");
    CHECK(drafted > 0);  // the demo model's greedy output repeats itself: lookup finds something to guess
    CHECK(accepted <= drafted);
    CHECK(samples.count("infer:spec_decode_num_accepted_tokens_total{instance=\"0\"}") == 1);
    CHECK(server.stop() == 0);
}
