// The serving API's fields, over real HTTP against `infer serve` with stories260K (a trained model, so its text is
// text): structured outputs (json_schema, json_object, regex, choices), tool calls (required, named, auto markup),
// logit_bias, echo, best_of, prompt arrays, content-part lists, chat template options, /tokenize and /detokenize,
// GET /v1/models/{id}, /v1/embeddings, unknown and refused fields, and the model_name label of /metrics.
#include "serve_support.hpp"

#include <fstream>
#include <regex>

using namespace serve_test;

namespace {

std::filesystem::path stories_gguf() { return test::shared_dir() / "models" / "stories260K" / "stories260K.gguf"; }

// One server for the suite: stories260K, the chatml template.
Server& stories_server() {
    static Server server({"-m", stories_gguf().string()});
    return server;
}

json post_json(int port, const std::string& path, const json& body, int expected = 200) {
    auto answer = post(port, path, body.dump());
    REQUIRE(answer);
    CAPTURE(answer->body);
    REQUIRE(answer->status == expected);
    return json::parse(answer->body);
}

const char* story_schema = R"({
  "type": "object",
  "properties": {
    "hero": {"type": "string", "minLength": 1, "maxLength": 10},
    "age": {"type": "integer", "minimum": 1, "maximum": 99},
    "mood": {"enum": ["happy", "sad", "brave"]},
    "has_pet": {"type": "boolean"},
    "friends": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    "pet": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog", "bird"]}, "legs": {"type": "integer", "minimum": 0, "maximum": 8}},
            "required": ["kind"]},
    "nickname": {"anyOf": [{"type": "string", "maxLength": 6}, {"type": "null"}]}
  },
  "required": ["hero", "age", "mood", "has_pet"]
})";

const char* weather_tool = R"({"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 12},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7}, "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "days"]}}})";

}  // namespace

TEST_CASE("structured outputs: 50 seeded json_schema samples at temperature 1 all parse and validate") {
    REQUIRE_SHARED_OR_SKIP();
    const int port = stories_server().port();
    const json schema = json::parse(story_schema);
    const infer::Json schema_value = infer::Json::parse(story_schema);
    int stopped = 0;
    for (int seed = 0; seed < 50; ++seed) {
        json body = {{"prompt", "Once upon a time"}, {"max_tokens", 400}, {"temperature", 1}, {"seed", seed},
                     {"response_format", {{"type", "json_schema"}, {"json_schema", {{"name", "story"}, {"schema", schema}, {"strict", true}}}}}};
        json reply = post_json(port, "/v1/completions", body);
        const std::string text = reply["choices"][0]["text"];
        CAPTURE(text);
        CHECK(reply["choices"][0]["finish_reason"] == "stop");
        CHECK(test::valid_json(infer::Json::parse(text), schema_value));
        stopped += reply["choices"][0]["finish_reason"] == "stop";
    }
    CHECK(stopped == 50);

    // Streamed chat, the same constraint: the streamed text validates too.
    Streamed streamed = stream(port, "/v1/chat/completions",
                               json({{"messages", {{{"role", "user"}, {"content", "Tell me about a hero."}}}}, {"max_tokens", 400},
                                     {"seed", 7}, {"stream", true},
                                     {"response_format", {{"type", "json_schema"}, {"json_schema", {{"name", "story"}, {"schema", schema}}}}}})
                                   .dump());
    CHECK(streamed.events.back() == "[DONE]");
    CHECK(test::valid_json(infer::Json::parse(streamed.text), schema_value));
}

TEST_CASE("structured outputs: json_object, guided_regex, guided_choice, structured_outputs; conflicts and bad schemas named") {
    REQUIRE_SHARED_OR_SKIP();
    const int port = stories_server().port();
    // A story model writes stories inside the strings of any JSON object; a logit_bias towards '"' and '}' (the two
    // compose) makes it close them, so that most samples end within the budget.
    infer::Model model = infer::load_model(stories_gguf());
    const std::vector<std::optional<std::string>> bytes = infer::tokenizer_for(model).all_token_bytes();
    json bias = json::object();
    for (size_t id = 0; id < bytes.size(); ++id)
        if (bytes[id] && bytes[id]->find_first_of("\"}") != std::string::npos) bias[std::to_string(id)] = 6;
    REQUIRE(bias.size() >= 2);
    int objects = 0;
    for (int seed = 0; seed < 8; ++seed) {
        json reply = post_json(port, "/v1/completions", {{"prompt", "Once upon a time"}, {"max_tokens", 200}, {"seed", seed},
                                                         {"logit_bias", bias}, {"response_format", {{"type", "json_object"}}}});
        const std::string text = reply["choices"][0]["text"];
        CAPTURE(text);
        REQUIRE(!text.empty());
        CHECK(text[0] == '{');
        if (reply["choices"][0]["finish_reason"] == "stop") {  // cut short by max_tokens, it is a prefix of one
            CHECK(json::parse(text).is_object());
            ++objects;
        }
    }
    CHECK(objects > 0);

    const std::regex code("[0-9]{3}-[a-z]{2,4}");
    for (int seed = 0; seed < 5; ++seed) {
        json reply = post_json(port, "/v1/completions", {{"prompt", "The code is"}, {"max_tokens", 20}, {"seed", seed},
                                                         {"guided_regex", "[0-9]{3}-[a-z]{2,4}"}});
        const std::string text = reply["choices"][0]["text"];
        CHECK(std::regex_match(text, code));
        reply = post_json(port, "/v1/completions", {{"prompt", "The weather is"}, {"max_tokens", 20}, {"seed", seed},
                                                    {"guided_choice", {"sunny", "rainy", "very cold"}}});
        const std::string choice = reply["choices"][0]["text"];
        CHECK((choice == "sunny" || choice == "rainy" || choice == "very cold"));
        reply = post_json(port, "/v1/chat/completions", {{"messages", {{{"role", "user"}, {"content", "Yes or no?"}}}},
                                                         {"max_tokens", 10}, {"seed", seed},
                                                         {"structured_outputs", {{"choice", {"yes", "no"}}}}});
        const std::string answer = reply["choices"][0]["message"]["content"];
        CHECK((answer == "yes" || answer == "no"));
    }

    json both = post_json(port, "/v1/completions", {{"prompt", "x"}, {"guided_regex", "a+"}, {"guided_choice", {"b"}}}, 400);
    CHECK(both["error"]["param"] == "guided_choice");
    json pattern = post_json(port, "/v1/completions",
                             {{"prompt", "x"}, {"response_format", {{"type", "json_schema"}, {"json_schema", {{"name", "s"},
                              {"schema", {{"type", "object"}, {"properties", {{"id", {{"type", "string"}, {"pattern", "^a$"}}}}}}}}}}}}, 400);
    CHECK(pattern["error"]["param"] == "response_format");
    CHECK(pattern["error"]["message"] == "response_format.json_schema.schema at /properties/id: keyword \"pattern\" is not supported by structured outputs");
    json lookaround = post_json(port, "/v1/completions", {{"prompt", "x"}, {"guided_regex", "(?=a)a"}}, 400);
    CHECK(lookaround["error"]["param"] == "guided_regex");
    json type = post_json(port, "/v1/completions", {{"prompt", "x"}, {"response_format", {{"type", "yaml"}}}}, 400);
    CHECK(type["error"]["param"] == "response_format");
}

TEST_CASE("tool calls: required and named choices give arguments that validate, streamed as OpenAI streams them") {
    REQUIRE_SHARED_OR_SKIP();
    const int port = stories_server().port();
    const json tool = json::parse(weather_tool);
    const infer::Json parameters = infer::Json::parse(tool["function"]["parameters"].dump());
    const json messages = {{{"role", "user"}, {"content", "What is the weather in Oslo?"}}};
    for (int seed = 0; seed < 5; ++seed) {
        json reply = post_json(port, "/v1/chat/completions", {{"messages", messages}, {"tools", {tool}}, {"tool_choice", "required"},
                                                              {"parallel_tool_calls", false}, {"max_tokens", 200}, {"seed", seed}});
        const json& choice = reply["choices"][0];
        CAPTURE(choice.dump());
        CHECK(choice["finish_reason"] == "tool_calls");
        CHECK(choice["message"]["content"].is_null());
        REQUIRE(choice["message"]["tool_calls"].size() == 1);
        const json& call = choice["message"]["tool_calls"][0];
        CHECK(call["type"] == "function");
        CHECK(call["id"].get<std::string>().rfind("call_", 0) == 0);
        CHECK(call["function"]["name"] == "get_weather");
        CHECK(test::valid_json(infer::Json::parse(call["function"]["arguments"].get<std::string>()), parameters));
    }
    // A named function: the output is its arguments; streamed, the first delta names the call, the rest add arguments.
    Streamed named = stream(port, "/v1/chat/completions",
                            json({{"messages", messages}, {"tools", {tool}}, {"max_tokens", 200}, {"seed", 3}, {"stream", true},
                                  {"tool_choice", {{"type", "function"}, {"function", {{"name", "get_weather"}}}}}})
                                .dump());
    REQUIRE(named.tool_calls.size() == 1);
    CHECK(named.tool_calls[0]["function"]["name"] == "get_weather");
    CHECK(test::valid_json(infer::Json::parse(named.tool_calls[0]["function"]["arguments"].get<std::string>()), parameters));
    CHECK(named.last_choice_chunk["choices"][0]["finish_reason"] == "tool_calls");
    CHECK(named.text.empty());

    // A conversation that went through a call: the assistant's content is null, its call and the tool's answer render.
    json history = {{{"role", "user"}, {"content", "Weather in Oslo?"}},
                    {{"role", "assistant"}, {"content", nullptr},
                     {"tool_calls", {{{"id", "call_1"}, {"type", "function"}, {"function", {{"name", "get_weather"}, {"arguments", "{\"city\": \"Oslo\", \"days\": 1}"}}}}}}},
                    {{"role", "tool"}, {"tool_call_id", "call_1"}, {"content", "sunny, 20 C"}}};
    json after = post_json(port, "/v1/chat/completions", {{"messages", history}, {"tools", {tool}}, {"max_tokens", 8}, {"seed", 1}});
    CHECK(after["choices"][0]["message"]["role"] == "assistant");
    json rendered = post_json(port, "/tokenize", {{"messages", history}, {"tools", {tool}}});
    json text = post_json(port, "/detokenize", {{"tokens", rendered["tokens"]}});
    const std::string prompt = text["prompt"];
    const size_t tools_at = prompt.find("<tools>\n{");  // the tools as JSON, one a line, through the template's tojson
    CHECK(tools_at != std::string::npos);
    CHECK(prompt.find("\"name\": \"get_weather\"", tools_at) < prompt.find("</tools>"));
    CHECK(prompt.find("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\", \"days\": 1}}\n</tool_call>") != std::string::npos);
    CHECK(prompt.find("<tool_response>\nsunny, 20 C\n</tool_response>") != std::string::npos);

    json unknown = post_json(port, "/v1/chat/completions", {{"messages", messages}, {"tools", {tool}},
                                                            {"tool_choice", {{"type", "function"}, {"function", {{"name", "nope"}}}}}}, 400);
    CHECK(unknown["error"]["param"] == "tool_choice");
}

TEST_CASE("tool calls in auto mode: the model's markup parsed into calls, whole or streamed piece by piece") {
    using serve::ToolCallParser;
    using serve::ToolChoice;
    auto whole = [](const std::string& text, bool parallel = true) {
        return ToolCallParser::split(ToolChoice::Auto, "", parallel, "x", text);
    };
    auto [content, calls] = whole("Let me look.<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>");
    CHECK(content == "Let me look.");
    REQUIRE(calls.size() == 1);
    CHECK(calls[0].name == "get_weather");
    CHECK(calls[0].arguments == "{\"city\":\"Oslo\"}");
    CHECK(calls[0].id == "call_x_0");
    auto llama = whole("<|python_tag|>{\"name\": \"f\", \"parameters\": {\"a\": 1}}");
    REQUIRE(llama.second.size() == 1);
    CHECK(llama.second[0].name == "f");
    CHECK(llama.second[0].arguments == "{\"a\":1}");
    CHECK(llama.first.empty());
    CHECK(whole("Just text, {braces} and <tags>.").first == "Just text, {braces} and <tags>.");
    CHECK(whole("{\"not\": \"a call\"}").first == "{\"not\": \"a call\"}");
    CHECK(whole("<tool_call>not json</tool_call> after").first == "<tool_call>not json</tool_call> after");
    const std::string two = "<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call><tool_call>{\"name\": \"b\", \"arguments\": {}}</tool_call>";
    CHECK(whole(two).second.size() == 2);
    CHECK(whole(two, false).second.size() == 1);  // parallel_tool_calls false: the first only

    // Streamed one byte at a time: the same content and calls, and no byte of markup leaks into the content.
    for (const std::string& text : {std::string("Let me look.<tool_call>\n{\"name\": \"g\", \"arguments\": {\"q\": \"<x>\"}}\n</tool_call> Done."),
                                   std::string("  {\"name\": \"f\", \"parameters\": {}}"), std::string("plain <tool text")}) {
        ToolCallParser parser(ToolChoice::Auto, "", true, "x");
        std::string streamed_content;
        std::vector<serve::ToolCallDelta> deltas;
        for (char c : text) {
            ToolCallParser::Piece piece = parser.push(std::string(1, c));
            streamed_content += piece.content;
            deltas.insert(deltas.end(), piece.calls.begin(), piece.calls.end());
        }
        ToolCallParser::Piece rest = parser.finish();
        streamed_content += rest.content;
        deltas.insert(deltas.end(), rest.calls.begin(), rest.calls.end());
        auto [expected_content, expected_calls] = whole(text);
        CHECK(streamed_content == expected_content);
        CHECK(static_cast<size_t>(std::count_if(deltas.begin(), deltas.end(), [](const auto& d) { return d.first; })) == expected_calls.size());
    }
}

TEST_CASE("request fields: logit_bias, echo, best_of, prompt arrays, content parts, suffix") {
    REQUIRE_SHARED_OR_SKIP();
    const int port = stories_server().port();

    // logit_bias -100 on every token whose text holds an "e" (byte tokens included): no "e" can come out.
    infer::Model model = infer::load_model(stories_gguf());
    infer::Tokenizer tokenizer = infer::tokenizer_for(model);
    json bias = json::object();
    for (int id = 0; id < tokenizer.vocab_size(); ++id)
        if (tokenizer.decode(std::vector<int>{id}).find('e') != std::string::npos) bias[std::to_string(id)] = -100;
    REQUIRE(bias.size() > 20);
    for (int seed = 0; seed < 4; ++seed) {
        json reply = post_json(port, "/v1/completions", {{"prompt", "Once upon a time"}, {"max_tokens", 60}, {"seed", seed}, {"logit_bias", bias}});
        const std::string text = reply["choices"][0]["text"];
        CAPTURE(text);
        CHECK(text.find('e') == std::string::npos);
        CHECK(reply["usage"]["completion_tokens"].get<int>() > 10);
    }
    json bad_bias = post_json(port, "/v1/completions", {{"prompt", "x"}, {"logit_bias", {{"99999", 1}}}}, 400);
    CHECK(bad_bias["error"]["param"] == "logit_bias");
    CHECK(post_json(port, "/v1/completions", {{"prompt", "x"}, {"logit_bias", {{"5", 101}}}}, 400)["error"]["param"] == "logit_bias");

    // echo: the prompt, then the same completion as without it.
    json plain = post_json(port, "/v1/completions", {{"prompt", "Once upon a time"}, {"max_tokens", 12}, {"seed", 4}});
    json echoed = post_json(port, "/v1/completions", {{"prompt", "Once upon a time"}, {"max_tokens", 12}, {"seed", 4}, {"echo", true}});
    CHECK(echoed["choices"][0]["text"] == "Once upon a time" + plain["choices"][0]["text"].get<std::string>());
    Streamed echo_stream = stream(port, "/v1/completions", json({{"prompt", "Once upon a time"}, {"max_tokens", 12}, {"seed", 4},
                                                                 {"echo", true}, {"stream", true}}).dump());
    CHECK(echo_stream.text == echoed["choices"][0]["text"]);
    CHECK(post_json(port, "/v1/completions", {{"prompt", "x"}, {"echo", true}, {"logprobs", 1}}, 400)["error"]["param"] == "echo");

    // best_of 3: the one of the three samples (seeds s, s+1, s+2) with the highest cumulative logprob.
    double best = -1e300;
    std::string best_text;
    for (int sample = 0; sample < 3; ++sample) {
        json one = post_json(port, "/v1/completions", {{"prompt", "The dog"}, {"max_tokens", 10}, {"seed", 20 + sample}, {"logprobs", 0}});
        double sum = 0;
        for (const json& lp : one["choices"][0]["logprobs"]["token_logprobs"]) sum += lp.get<double>();
        if (sum > best) best = sum, best_text = one["choices"][0]["text"];
    }
    json best_of = post_json(port, "/v1/completions", {{"prompt", "The dog"}, {"max_tokens", 10}, {"seed", 20}, {"best_of", 3}});
    CHECK(best_of["choices"].size() == 1);
    CHECK(best_of["choices"][0]["text"] == best_text);
    CHECK(best_of["choices"][0]["logprobs"].is_null());  // ranked by them, not asked for them
    CHECK(best_of["usage"]["completion_tokens"] == 30);  // every sample was generated
    CHECK(post_json(port, "/v1/completions", {{"prompt", "x"}, {"best_of", 1}, {"n", 2}}, 400)["error"]["param"] == "best_of");
    CHECK(post_json(port, "/v1/completions", {{"prompt", "x"}, {"best_of", 2}, {"stream", true}}, 400)["error"]["param"] == "best_of");

    // An array of prompts: n choices each, in order, the prompt tokens counted once per prompt.
    json many = post_json(port, "/v1/completions", {{"prompt", {"Once upon a time", "The dog"}}, {"max_tokens", 4}, {"n", 2},
                                                    {"seed", 1}, {"echo", true}});
    REQUIRE(many["choices"].size() == 4);
    for (int i = 0; i < 4; ++i) {
        CHECK(many["choices"][i]["index"] == i);
        CHECK(many["choices"][i]["text"].get<std::string>().rfind(i < 2 ? "Once upon a time" : "The dog", 0) == 0);
    }
    json ids = post_json(port, "/tokenize", {{"prompt", "Once upon a time"}});
    json ids2 = post_json(port, "/tokenize", {{"prompt", "The dog"}});
    CHECK(many["usage"]["prompt_tokens"] == ids["count"].get<int>() + ids2["count"].get<int>());
    json id_lists = post_json(port, "/v1/completions", {{"prompt", {ids["tokens"], ids2["tokens"]}}, {"max_tokens", 3}, {"temperature", 0}});
    CHECK(id_lists["choices"].size() == 2);

    // Content as a list of parts reads as the joined text; parts that are not text are refused by type.
    const json parts = {{{"role", "user"}, {"content", {{{"type", "text"}, {"text", "Hello"}}, {{"type", "text"}, {"text", "there"}}}}}};
    const json joined = {{{"role", "user"}, {"content", "Hello\nthere"}}};
    json a = post_json(port, "/v1/chat/completions", {{"messages", parts}, {"max_tokens", 6}, {"temperature", 0}});
    json b = post_json(port, "/v1/chat/completions", {{"messages", joined}, {"max_tokens", 6}, {"temperature", 0}});
    CHECK(a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]);
    CHECK(a["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"]);
    json image = post_json(port, "/v1/chat/completions",
                           {{"messages", {{{"role", "user"}, {"content", {{{"type", "image_url"}, {"image_url", {{"url", "x"}}}}}}}}}}, 400);
    CHECK(image["error"]["message"].get<std::string>().find("\"image_url\"") != std::string::npos);

    // suffix needs fill-in-the-middle tokens, which stories260K has not.
    json suffix = post_json(port, "/v1/completions", {{"prompt", "def f("}, {"suffix", "return x"}}, 400);
    CHECK(suffix["error"]["param"] == "suffix");
}

TEST_CASE("chat template options, /tokenize and /detokenize, /v1/models/{id}, embeddings, unknown and refused fields") {
    REQUIRE_SHARED_OR_SKIP();
    test::TempDir dir("api");
    const std::filesystem::path template_file = dir.path() / "greeting.jinja";
    test::write_file(template_file, "{{ greeting | default('Hi') }}:{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
                                    "{% if add_generation_prompt %}[assistant]{% endif %}");
    Server server({"-m", stories_gguf().string(), "--chat-template", template_file.string()});
    const int port = server.port();
    auto rendered = [&](json body) {
        json ids = post_json(port, "/tokenize", body);
        return post_json(port, "/detokenize", {{"tokens", ids["tokens"]}})["prompt"].get<std::string>();
    };
    const json messages = {{{"role", "user"}, {"content", "Once"}}, {{"role", "assistant"}, {"content", "upon a"}}};
    CHECK(rendered({{"messages", messages}}) == "Hi:[user]Once[assistant]upon a[assistant]");
    CHECK(rendered({{"messages", messages}, {"add_generation_prompt", false}}) == "Hi:[user]Once[assistant]upon a");
    CHECK(rendered({{"messages", messages}, {"chat_template_kwargs", {{"greeting", "Hey"}}}}) == "Hey:[user]Once[assistant]upon a[assistant]");
    // continue_final_message: the prompt ends where the assistant's text ends, and the reply continues it.
    json more = {{"messages", {{{"role", "user"}, {"content", "Once"}}, {{"role", "assistant"}, {"content", "upon a time there"}},
                               {{"role", "user"}, {"content", "x"}}, {{"role", "assistant"}, {"content", "upon a"}}}},
                 {"continue_final_message", true}, {"add_generation_prompt", false}};
    CHECK(rendered(more) == "Hi:[user]Once[assistant]upon a time there[user]x[assistant]upon a");
    json bad_continue = post_json(port, "/v1/chat/completions", {{"messages", {{{"role", "user"}, {"content", "x"}}}}, {"continue_final_message", true}}, 400);
    CHECK(bad_continue["error"]["param"] == "continue_final_message");
    CHECK(post_json(port, "/v1/chat/completions", {{"messages", messages}, {"chat_template_kwargs", {{"messages", 1}}}}, 400)["error"]["param"] ==
          "chat_template_kwargs");

    // /tokenize round-trips; /detokenize refuses ids outside the vocabulary.
    for (const std::string text : {"Once upon a time, Lily saw a big red ball.", "Tim said \"hi!\"\n\tThe end."}) {
        json ids = post_json(port, "/tokenize", {{"prompt", text}, {"return_token_strs", true}});
        CHECK(ids["count"] == ids["tokens"].size());
        CHECK(ids["token_strs"].size() == ids["tokens"].size());
        CHECK(ids["max_model_len"].get<int>() > 0);
        CHECK(post_json(port, "/detokenize", {{"tokens", ids["tokens"]}})["prompt"] == text);
        json bare = post_json(port, "/tokenize", {{"prompt", text}, {"add_special_tokens", false}});
        CHECK(bare["count"].get<int>() == ids["count"].get<int>() - 1);  // stories260K adds BOS
    }
    CHECK(post_json(port, "/detokenize", {{"tokens", {1, 99999}}}, 400)["error"]["param"] == "tokens");

    httplib::Client client("127.0.0.1", port);
    auto model = client.Get("/v1/models/stories260K.gguf");
    REQUIRE(model);
    CHECK(model->status == 200);
    CHECK(json::parse(model->body)["id"] == "stories260K.gguf");
    auto missing = client.Get("/v1/models/gpt-4");
    REQUIRE(missing);
    CHECK(missing->status == 404);
    json embeddings = post_json(port, "/v1/embeddings", {{"input", "hello"}, {"model", "stories260K.gguf"}}, 400);
    CHECK(embeddings["error"]["message"].get<std::string>().find("this model does not produce embeddings") != std::string::npos);

    // An unknown field: ignored, with a warning line; a known one this server does not implement: 400 by name.
    json unknown = post_json(port, "/v1/completions", {{"prompt", "Once"}, {"max_tokens", 2}, {"frobnicate", true}});
    CHECK(unknown["choices"].size() == 1);
    for (const char* field : {"functions", "min_tokens", "prompt_logprobs", "use_beam_search", "guided_grammar"}) {
        json refused = post_json(port, "/v1/chat/completions", {{"messages", messages}, {field, 1}}, 400);
        CHECK(refused["error"]["param"] == field);
    }
    CHECK(post_json(port, "/v1/chat/completions", {{"messages", messages}, {"echo", true}}, 400)["error"]["param"] == "echo");

    // Every series of /metrics carries the model's name.
    auto text = client.Get("/metrics");
    REQUIRE(text);
    int series = 0;
    std::istringstream lines(text->body);
    for (std::string line; std::getline(lines, line);) {
        if (line.empty() || line[0] == '#') continue;
        CAPTURE(line);
        CHECK(line.find("model_name=\"stories260K.gguf\"") != std::string::npos);
        ++series;
    }
    CHECK(series > 10);
    CHECK(server.stop() == 0);
    CHECK(server.log().find("warning: /v1/completions: ignoring unknown request field(s): frobnicate") != std::string::npos);
}
