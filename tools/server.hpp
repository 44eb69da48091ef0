// server.hpp — the serving framework's logic, kept apart from the HTTP plumbing so the tests can include it: OpenAI
// request bodies to engine requests (shared with `infer run-batch`), OpenAI response and error bodies, the metrics
// registry in Prometheus' text format, admission control, and the routing policies (round-robin, least-loaded,
// prefix-aware). Standard library, infer.hpp and chat_template.hpp only; the HTTP server (`infer serve`,
// serve.cpp) and the proxy (`infer route`, route.cpp) put cpp-httplib around it.  (chapters 08 and 09)
#pragma once

#include "infer.hpp"
#include "chat_template.hpp"

#include <atomic>
#include <charconv>
#include <cmath>
#include <functional>
#include <map>
#include <mutex>
#include <numeric>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace serve {

// =====================================================================================================================
// Errors — OpenAI's error object {"error": {"message", "type", "param", "code"}} with the HTTP status that goes with it.
// =====================================================================================================================

struct HttpError : infer::Error {
    HttpError(int status, std::string message, std::string param = "")
        : infer::Error(std::move(message)), status(status), param(std::move(param)) {}
    int status;
    std::string param;  // the request field at fault, when there is one
};

// OpenAI's error types by status (vLLM and the OpenAI API use the same names).
inline const char* error_type(int status) {
    switch (status) {
    case 400: return "invalid_request_error";  // also 413 in OpenAI's API: the request itself is at fault
    case 401: return "authentication_error";
    case 404: return "not_found_error";
    case 413: return "invalid_request_error";
    case 429: return "rate_limit_error";
    case 503: return "service_unavailable_error";
    default: return status >= 500 ? "internal_server_error" : "invalid_request_error";
    }
}

inline std::string json_string(std::string_view text) {
    std::ostringstream out;
    infer::write_json_string(out, text);
    return out.str();
}

inline std::string error_body(int status, std::string_view message, std::string_view param = "") {
    return "{\"error\":{\"message\":" + json_string(message) + ",\"type\":\"" + error_type(status) +
           "\",\"param\":" + (param.empty() ? std::string("null") : json_string(param)) + ",\"code\":" +
           std::to_string(status) + "}}";
}

// =====================================================================================================================
// Requests — an OpenAI /v1/completions or /v1/chat/completions body to engine requests. One implementation for
// `infer serve` and `infer run-batch`. Defaults are OpenAI's: temperature 1, top_p 1, 16 tokens for a completion,
// the rest of the context for a chat reply (as vLLM). Every field is handled or refused by name; a field this server
// does not know is ignored with a warning line, as vLLM does.
// =====================================================================================================================

inline constexpr int max_choices = 16;  // "n" and "best_of": at most this many per prompt
inline constexpr int max_prompts = 64;  // a completions "prompt" array: at most this many prompts
inline constexpr int max_generated_tokens = 1 << 24;  // "max_tokens": larger than any context, small enough to add

// How a chat request's tools may be called. Auto: the model decides, and its tool-call markup is parsed out of the
// text; Required: the output is constrained to a list of calls; Named: to the arguments of one function.
enum class ToolChoice { None, Auto, Required, Named };

struct Tool {
    std::string name;
    infer::Json parameters;  // a JSON Schema ({"type": "object", ...}); an empty object schema when absent
};

struct CompletionRequest {
    bool chat = false;
    std::string model;                      // as the client named it ("" when absent)
    std::vector<std::vector<int>> prompts;  // one, or one per element of a completions prompt array
    std::vector<std::string> prompt_texts;  // the same as text, for "echo"
    infer::SamplingParams params;
    std::vector<std::string> stop;
    bool stream = false;
    bool include_usage = false;       // stream_options.include_usage: one more chunk with the usage
    bool max_tokens_given = false;    // false: the default, which the server may shrink to the room left
    int n = 1;                        // choices per prompt
    int best_of = 1;                  // samples per prompt (>= n): the n with the highest cumulative logprob are returned
    bool logprobs_asked = false;      // the client asked for logprobs (best_of may turn them on for its own ranking)
    bool echo = false;                // completions: the prompt's text before each choice's text
    ToolChoice tool_choice = ToolChoice::None;
    std::vector<Tool> tools;
    bool parallel_tool_calls = true;
    std::string named_tool;           // ToolChoice::Named: the function
    std::vector<std::string> ignored_fields;  // unknown fields, for the server's warning line
    double tokenize_seconds = 0;      // chat template + tokenizer time, for the timing breakdown

    int engine_requests_per_prompt() const { return best_of; }
};

// Grammars compiled for structured outputs, kept by their expression so that a schema sent again costs nothing, and
// the vocabulary's trie, built on first use. Shared by the requests of one server (thread-safe).
class GrammarCache {
public:
    explicit GrammarCache(const infer::Tokenizer* tokenizer) : tokenizer_(tokenizer) {}

    std::shared_ptr<const infer::Grammar> get(const std::string& regex, const std::string& description) {
        std::lock_guard lock(mutex_);
        if (!tokenizer_) infer::fail("structured outputs need the model's tokenizer, and this model has none");
        if (auto found = grammars_.find(regex); found != grammars_.end()) return found->second;
        if (!trie_) trie_ = std::make_shared<const infer::TokenTrie>(*tokenizer_);
        auto grammar = std::make_shared<const infer::Grammar>(regex, trie_, description);
        if (grammars_.size() >= capacity) grammars_.erase(grammars_.begin());  // bounded: clients may send many schemas
        grammars_.emplace(regex, grammar);
        return grammar;
    }

    static constexpr size_t capacity = 16;  // each holds its masks (V bits per state reached): a bound on memory

private:
    const infer::Tokenizer* tokenizer_;
    std::mutex mutex_;
    std::shared_ptr<const infer::TokenTrie> trie_;
    std::map<std::string, std::shared_ptr<const infer::Grammar>> grammars_;
};

// What parsing needs from the server: the model (context, vocabulary), its tokenizer, how to render chat messages
// (messages, add_generation_prompt, extra template variables such as tools and chat_template_kwargs) and where
// grammars come from.
struct RequestContext {
    const infer::Model* model = nullptr;
    const infer::Tokenizer* tokenizer = nullptr;
    std::function<std::string(const infer::Json& messages, bool add_generation_prompt, const infer::Json& extra)> render_chat;
    GrammarCache* grammars = nullptr;  // nullptr: structured outputs are refused
};

// The chat template to render with: `choice` (a built-in name or a file), else the tokenizer's own.
inline std::string chat_template_source(const std::string& choice, const infer::Tokenizer& tokenizer) {
    if (!choice.empty()) {
        if (const char* builtin = chat::builtin_template(choice)) return builtin;
        if (!std::filesystem::is_regular_file(choice))
            infer::fail("--chat-template ", choice,
                                ": neither a built-in template (chatml, llama3, llama2) nor a readable file");
        return infer::read_text_file(choice);
    }
    if (tokenizer.chat_template().empty())
        infer::fail(tokenizer.source(), " has no chat template (no chat_template in its tokenizer_config.json or "
                            "GGUF metadata); choose one with --chat-template chatml|llama3|llama2|FILE");
    return tokenizer.chat_template();
}

// The variables transformers passes besides the messages: the special tokens the tokenizer defines (an unset one is
// left out, so `bos_token is defined` stays false for a model without one).
inline infer::Json template_variables(const infer::Tokenizer& tokenizer) {
    infer::Json::Object variables;
    if (!tokenizer.bos_token().empty()) variables.emplace_back("bos_token", infer::Json(tokenizer.bos_token()));
    if (!tokenizer.eos_token().empty()) variables.emplace_back("eos_token", infer::Json(tokenizer.eos_token()));
    return infer::Json(std::move(variables));
}

// `base` (an object) with the members of `more` added or replaced.
inline infer::Json merged(const infer::Json& base, const infer::Json& more) {
    infer::Json::Object out = base.is_object() ? base.as_object() : infer::Json::Object{};
    if (more.is_object())
        for (const auto& member : more.as_object()) {
            auto same = std::find_if(out.begin(), out.end(), [&](const auto& existing) { return existing.first == member.first; });
            if (same != out.end()) same->second = member.second;
            else out.push_back(member);
        }
    return infer::Json(std::move(out));
}

namespace detail {

[[noreturn]] inline void bad(const std::string& param, const std::string& message) { throw HttpError(400, message, param); }

// A number field of the body, or `fallback` when absent or null.
inline double number(const infer::Json& body, const char* name, double fallback) {
    const infer::Json* value = body.find(name);
    if (!value || value->is_null()) return fallback;
    if (!value->is_number()) bad(name, infer::concat("body field \"", name, "\" must be a number"));
    return value->as_number();
}

inline bool flag(const infer::Json& body, const char* name, bool fallback) {
    const infer::Json* value = body.find(name);
    if (!value || value->is_null()) return fallback;
    if (!value->is_bool()) bad(name, infer::concat("body field \"", name, "\" must be true or false"));
    return value->as_bool();
}

inline int whole(double value, const char* name, double low, double high) {
    auto text = [](double x) {  // shortest exact spelling: 2147483647, not 2.14748e+09
        char buffer[32];
        return std::string(buffer, std::to_chars(buffer, buffer + sizeof buffer, x).ptr);
    };
    if (!(value >= low && value <= high) || value != std::floor(value))
        bad(name, infer::concat("body field \"", name, "\" must be a whole number in [", text(low), ", ", text(high), "], found ", text(value)));
    return static_cast<int>(value);
}

// The fields each endpoint handles. Anything else is either refused by name (below) or unknown (ignored, warned).
inline const std::set<std::string, std::less<>>& handled_fields(bool chat) {
    static const std::set<std::string, std::less<>> common = {
        "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "n", "best_of", "stream",
        "stream_options", "logprobs", "stop", "presence_penalty", "frequency_penalty", "repetition_penalty", "seed",
        "ignore_eos", "logit_bias", "user", "response_format", "guided_json", "guided_regex", "guided_choice",
        "structured_outputs", "add_special_tokens"};
    static const std::set<std::string, std::less<>> completions = [] {
        auto fields = common;
        fields.insert({"prompt", "echo", "suffix"});
        return fields;
    }();
    static const std::set<std::string, std::less<>> chat_fields = [] {
        auto fields = common;
        fields.insert({"messages", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs",
                       "add_generation_prompt", "continue_final_message", "echo"});
        return fields;
    }();
    return chat ? chat_fields : completions;
}

// Fields OpenAI or vLLM define that change the output in ways this server does not implement: a 400 that names them.
inline const std::map<std::string, std::string, std::less<>>& refused_fields() {
    static const std::map<std::string, std::string, std::less<>> fields = {
        {"functions", "the legacy \"functions\" field is not supported; send \"tools\""},
        {"function_call", "the legacy \"function_call\" field is not supported; send \"tool_choice\""},
        {"audio", "audio output is not supported"},
        {"modalities", "only text output is supported"},
        {"prediction", "predicted outputs are not supported"},
        {"store", "stored completions are not supported"},
        {"metadata", "stored completions (metadata) are not supported"},
        {"service_tier", "service tiers are not supported"},
        {"reasoning_effort", "reasoning effort is not supported"},
        {"web_search_options", "web search is not supported"},
        {"guided_grammar", "grammars other than JSON, regular expressions and choices are not supported"},
        {"chat_template", "a per-request chat template is not supported; start the server with --chat-template"},
        {"documents", "documents (retrieval-augmented templates) are not supported"},
        {"min_tokens", "min_tokens is not supported"},
        {"stop_token_ids", "stop_token_ids is not supported; use \"stop\" strings"},
        {"include_stop_str_in_output", "include_stop_str_in_output is not supported"},
        {"skip_special_tokens", "skip_special_tokens is not supported"},
        {"spaces_between_special_tokens", "spaces_between_special_tokens is not supported"},
        {"prompt_logprobs", "prompt_logprobs is not supported"},
        {"use_beam_search", "beam search is not supported"},
        {"length_penalty", "length_penalty (beam search) is not supported"},
        {"allowed_token_ids", "allowed_token_ids is not supported; use \"logit_bias\" or \"structured_outputs\""},
        {"bad_words", "bad_words is not supported; use \"logit_bias\""},
        {"truncate_prompt_tokens", "truncate_prompt_tokens is not supported"},
        {"guided_decoding_backend", "there is one structured-output backend; leave guided_decoding_backend out"},
        {"guided_whitespace_pattern", "guided_whitespace_pattern is not supported"},
        {"return_tokens_as_token_ids", "return_tokens_as_token_ids is not supported"},
        {"priority", "request priorities are not supported"},
    };
    return fields;
}

// A chat message list made renderable: content-part lists joined (text parts only), null content (an assistant
// message that only calls tools) as "", every message an object with a string role.
inline infer::Json normalized_messages(const infer::Json& messages) {
    infer::Json::Array out;
    for (size_t i = 0; i < messages.as_array().size(); ++i) {
        const infer::Json& message = messages.as_array()[i];
        const std::string where = infer::concat("messages[", i, "]");
        if (!message.is_object()) bad("messages", where + " must be an object");
        const infer::Json* role = message.find("role");
        if (!role || !role->is_string()) bad("messages", where + " needs a string \"role\"");
        infer::Json::Object copy = message.as_object();
        for (auto& [key, value] : copy) {
            if (key != "content") continue;
            if (value.is_null()) {
                value = infer::Json(std::string());
            } else if (value.is_array()) {
                std::string text;
                for (size_t j = 0; j < value.as_array().size(); ++j) {
                    const infer::Json& part = value.as_array()[j];
                    const infer::Json* type = part.find("type");
                    const std::string part_where = infer::concat(where, ".content[", j, "]");
                    if (!type || !type->is_string()) bad("messages", part_where + " needs a string \"type\"");
                    if (type->as_string() != "text")
                        bad("messages", infer::concat(part_where, ": content parts of type \"", type->as_string(),
                                                      "\" are not supported: this model reads text only"));
                    const infer::Json* part_text = part.find("text");
                    if (!part_text || !part_text->is_string()) bad("messages", part_where + " needs a string \"text\"");
                    text += (j ? "\n" : "") + part_text->as_string();  // joined with newlines, as vLLM joins them
                }
                value = infer::Json(std::move(text));
            } else if (!value.is_string()) {
                bad("messages", where + ".content must be a string, an array of content parts or null");
            }
        }
        out.push_back(infer::Json(std::move(copy)));
    }
    return infer::Json(std::move(out));
}

// "tools": [{"type": "function", "function": {"name", "description", "parameters"}}].
inline std::vector<Tool> parse_tools(const infer::Json& tools) {
    if (!tools.is_array()) bad("tools", "body field \"tools\" must be an array");
    std::vector<Tool> out;
    for (size_t i = 0; i < tools.as_array().size(); ++i) {
        const infer::Json& tool = tools.as_array()[i];
        const std::string where = infer::concat("tools[", i, "]");
        const infer::Json* type = tool.find("type");
        if (!type || !type->is_string() || type->as_string() != "function")
            bad("tools", where + ": only tools of \"type\": \"function\" are supported");
        const infer::Json* function = tool.find("function");
        const infer::Json* name = function ? function->find("name") : nullptr;
        if (!name || !name->is_string() || name->as_string().empty()) bad("tools", where + ".function needs a string \"name\"");
        Tool t{name->as_string(), infer::Json(infer::Json::Object{{"type", infer::Json(std::string("object"))},
                                                                  {"properties", infer::Json(infer::Json::Object{})}})};
        if (const infer::Json* parameters = function->find("parameters"); parameters && !parameters->is_null()) {
            if (!parameters->is_object()) bad("tools", where + ".function.parameters must be a JSON Schema object");
            t.parameters = *parameters;
        }
        out.push_back(std::move(t));
    }
    return out;
}

// The expression a "tool_choice": "required" output must match: a JSON array of {"name", "parameters"} objects, one
// alternative per tool with that tool's own parameter schema (vLLM's shape for required tool calls).
inline std::string required_tools_regex(const std::vector<Tool>& tools, bool parallel) {
    std::string call = "(";
    for (size_t i = 0; i < tools.size(); ++i)
        call += (i ? "|" : "") + std::string("\\{\"name\":") + infer::json_regex::space + infer::regex_escape(infer::Json(tools[i].name).dump()) +
                "," + infer::json_regex::space + "\"parameters\":" + infer::json_regex::space +
                infer::regex_for_json_schema(tools[i].parameters, "tools[" + std::to_string(i) + "].function.parameters") + "\\}";
    call += ")";
    return "\\[" + call + (parallel ? "(," + infer::json_regex::space + call + ")*" : "") + "\\]";
}

}  // namespace detail

inline CompletionRequest parse_request(const infer::Json& body, bool chat, const RequestContext& context) {
    using detail::bad;
    if (!body.is_object()) bad("", "the request body must be a JSON object");
    CompletionRequest r;
    r.chat = chat;
    const infer::Model& model = *context.model;
    for (const auto& [key, _] : body.as_object()) {
        if (detail::handled_fields(chat).count(key)) continue;
        if (auto refused = detail::refused_fields().find(key); refused != detail::refused_fields().end())
            bad(key, infer::concat("body field \"", key, "\": ", refused->second));
        r.ignored_fields.push_back(key);
    }
    if (const infer::Json* m = body.find("model"); m && !m->is_null()) {
        if (!m->is_string()) bad("model", "body field \"model\" must be a string");
        r.model = m->as_string();
    }
    if (const infer::Json* user = body.find("user"); user && !user->is_null() && !user->is_string())
        bad("user", "body field \"user\" must be a string");  // an end-user id for the client's records; it changes no output
    r.n = detail::whole(detail::number(body, "n", 1), "n", 1, max_choices);
    r.best_of = detail::whole(detail::number(body, "best_of", r.n), "best_of", 1, max_choices);
    if (r.best_of < r.n) bad("best_of", infer::concat("body field \"best_of\" (", r.best_of, ") must be >= n (", r.n, ")"));
    // Log-probabilities: completions take "logprobs": k (the sampled token and the k likeliest); chat takes
    // "logprobs": true with "top_logprobs": k, as OpenAI's two APIs spell it.
    const int most = infer::SamplingParams::max_logprobs;
    if (chat) {
        const bool wanted = detail::flag(body, "logprobs", false);
        const double top = detail::number(body, "top_logprobs", -1);
        if (top >= 0 && !wanted) bad("top_logprobs", "body field \"top_logprobs\" needs \"logprobs\": true");
        if (wanted) r.params.logprobs = top < 0 ? 0 : detail::whole(top, "top_logprobs", 0, most);
    } else if (const infer::Json* lp = body.find("logprobs"); lp && !lp->is_null()) {
        if (!lp->is_number()) bad("logprobs", "body field \"logprobs\" must be a whole number of alternatives (0 to 20)");
        r.params.logprobs = detail::whole(lp->as_number(), "logprobs", 0, most);
    }
    r.logprobs_asked = r.params.logprobs >= 0;
    if (r.best_of > r.n && r.params.logprobs < 0) r.params.logprobs = 0;  // the ranking needs each token's logprob
    r.stream = detail::flag(body, "stream", false);
    if (const infer::Json* options = body.find("stream_options"); options && !options->is_null()) {
        if (!options->is_object()) bad("stream_options", "body field \"stream_options\" must be an object");
        if (!r.stream) bad("stream_options", "body field \"stream_options\" is only allowed when \"stream\" is true");
        r.include_usage = detail::flag(*options, "include_usage", false);
        for (const auto& [key, _] : options->as_object())
            if (key != "include_usage") r.ignored_fields.push_back("stream_options." + key);
    }
    if (r.stream && r.best_of > r.n) bad("best_of", "\"best_of\" greater than \"n\" cannot stream: the best are known only at the end");
    r.echo = detail::flag(body, "echo", false);
    if (r.echo && chat) bad("echo", "body field \"echo\" belongs to /v1/completions; a chat reply does not repeat the messages");
    if (r.echo && r.logprobs_asked)
        bad("echo", "\"echo\" with \"logprobs\" would need the prompt's log-probabilities, which this server does not compute");

    // Tools (chat): rendered through the template; tool_choice decides whether the output is constrained to calls.
    if (chat) {
        if (const infer::Json* tools = body.find("tools"); tools && !tools->is_null()) r.tools = detail::parse_tools(*tools);
        r.parallel_tool_calls = detail::flag(body, "parallel_tool_calls", true);
        r.tool_choice = r.tools.empty() ? ToolChoice::None : ToolChoice::Auto;
        if (const infer::Json* choice = body.find("tool_choice"); choice && !choice->is_null()) {
            if (choice->is_string() && choice->as_string() == "none") r.tool_choice = ToolChoice::None;
            else if (choice->is_string() && (choice->as_string() == "auto" || choice->as_string() == "required"))
                r.tool_choice = choice->as_string() == "auto" ? ToolChoice::Auto : ToolChoice::Required;
            else if (const infer::Json* function = choice->find("function"); function && function->find("name") &&
                                                                            function->find("name")->is_string()) {
                r.tool_choice = ToolChoice::Named;
                r.named_tool = function->find("name")->as_string();
            } else {
                bad("tool_choice", "body field \"tool_choice\" must be \"none\", \"auto\", \"required\" or "
                                   "{\"type\": \"function\", \"function\": {\"name\": ...}}");
            }
            if (r.tool_choice != ToolChoice::None && r.tools.empty())
                bad("tool_choice", "body field \"tool_choice\" asks for a tool call, but the request has no \"tools\"");
            if (r.tool_choice == ToolChoice::Named &&
                std::none_of(r.tools.begin(), r.tools.end(), [&](const Tool& t) { return t.name == r.named_tool; }))
                bad("tool_choice", "tool_choice names function \"" + r.named_tool + "\", which is not in \"tools\"");
        }
    }

    infer::Stopwatch clock;
    if (chat) {
        const infer::Json* messages = body.find("messages");
        if (!messages || !messages->is_array()) bad("messages", "a chat request's body needs an array field \"messages\"");
        if (messages->as_array().empty()) bad("messages", "body field \"messages\" must not be empty");
        if (!context.tokenizer) bad("messages", model.source + " has no tokenizer to render chat messages with");
        const infer::Json rendered_messages = detail::normalized_messages(*messages);
        bool add_generation_prompt = detail::flag(body, "add_generation_prompt", true);
        const bool continue_final = detail::flag(body, "continue_final_message", false);
        if (continue_final) {
            if (body.find("add_generation_prompt") && add_generation_prompt)
                bad("continue_final_message", "\"continue_final_message\" and \"add_generation_prompt\" cannot both be true");
            const infer::Json& last = rendered_messages.as_array().back();
            if (last.at("role").as_string() != "assistant")
                bad("continue_final_message", "\"continue_final_message\" needs the last message to be the assistant's");
            add_generation_prompt = false;
        }
        infer::Json extra = infer::Json(infer::Json::Object{});
        if (const infer::Json* kwargs = body.find("chat_template_kwargs"); kwargs && !kwargs->is_null()) {
            if (!kwargs->is_object()) bad("chat_template_kwargs", "body field \"chat_template_kwargs\" must be an object");
            for (const char* reserved : {"messages", "add_generation_prompt", "tools"})
                if (kwargs->find(reserved))
                    bad("chat_template_kwargs", infer::concat("chat_template_kwargs may not set \"", reserved, "\": it is a request field of its own"));
            extra = merged(extra, *kwargs);
        }
        if (const infer::Json* tools = body.find("tools"); tools && !tools->is_null())
            extra = merged(extra, infer::Json(infer::Json::Object{{"tools", *tools}}));
        std::string text;
        try {
            text = context.render_chat(rendered_messages, add_generation_prompt, extra);
        } catch (const HttpError&) {
            throw;
        } catch (const infer::Error& e) {
            bad("messages", e.what());
        }
        if (continue_final) {  // end the prompt where the final message's text ends, so the reply continues it
            const std::string& content = rendered_messages.as_array().back().at("content").as_string();
            const size_t at = content.empty() ? std::string::npos : text.rfind(content);
            if (at == std::string::npos)
                bad("continue_final_message", "the final message's text is empty or does not appear in the rendered prompt");
            text.resize(at + content.size());
        }
        r.prompts.push_back(context.tokenizer->encode(text, detail::flag(body, "add_special_tokens", false)));
        r.prompt_texts.push_back(std::move(text));
    } else {
        const infer::Json* prompt = body.find("prompt");
        if (!prompt || prompt->is_null()) bad("prompt", "a completion request's body needs a field \"prompt\"");
        const bool add_special = detail::flag(body, "add_special_tokens", true);
        auto add_text = [&](const std::string& text) {
            if (!context.tokenizer) bad("prompt", model.source + " has no tokenizer: give \"prompt\" as an array of token ids");
            r.prompts.push_back(context.tokenizer->encode(text, add_special));
            r.prompt_texts.push_back(text);
        };
        auto add_ids = [&](const infer::Json& ids) {
            std::vector<int> tokens;
            for (const infer::Json& id : ids.as_array()) {
                if (!id.is_number() || id.as_number() != std::floor(id.as_number()) || id.as_number() < 0 ||
                    id.as_number() >= model.config.vocab_size)
                    bad("prompt", infer::concat("\"prompt\" holds a value that is not a token id of this vocabulary (",
                                                model.config.vocab_size, " tokens)"));
                tokens.push_back(static_cast<int>(id.as_int()));
            }
            r.prompt_texts.push_back(context.tokenizer ? context.tokenizer->decode(tokens) : std::string());
            r.prompts.push_back(std::move(tokens));
        };
        // A string, an array of ids, or an array of either: one prompt each, their choices in order.
        if (prompt->is_string()) {
            add_text(prompt->as_string());
        } else if (prompt->is_array() && (prompt->as_array().empty() || prompt->as_array()[0].is_number())) {
            add_ids(*prompt);
        } else if (prompt->is_array()) {
            if (prompt->as_array().size() > static_cast<size_t>(max_prompts))
                bad("prompt", infer::concat("\"prompt\" holds ", prompt->as_array().size(), " prompts; at most ", max_prompts, " per request"));
            for (const infer::Json& item : prompt->as_array()) {
                if (item.is_string()) add_text(item.as_string());
                else if (item.is_array()) add_ids(item);
                else bad("prompt", "\"prompt\" must be a string, an array of token ids, or an array of strings or of id arrays");
            }
        } else {
            bad("prompt", "\"prompt\" must be a string, an array of token ids, or an array of strings or of id arrays");
        }
        for (const std::vector<int>& p : r.prompts)
            if (p.empty()) bad("prompt", "\"prompt\" is empty: nothing to condition on");
        if (const infer::Json* suffix = body.find("suffix"); suffix && !suffix->is_null()) {
            if (!suffix->is_string()) bad("suffix", "body field \"suffix\" must be a string");
            // Fill-in-the-middle: prefix, suffix, then the model writes the middle (the PSM order of code models).
            const infer::Tokenizer* tok = context.tokenizer;
            auto special = [&](std::initializer_list<const char*> names) -> int {
                for (const char* name : names) {
                    if (!tok) break;
                    std::vector<int> ids = tok->encode(name, false);
                    if (ids.size() == 1 && tok->token_text(ids[0]) == name) return ids[0];
                }
                return -1;
            };
            const int pre = special({"<|fim_prefix|>", "<fim_prefix>"}), suf = special({"<|fim_suffix|>", "<fim_suffix>"}),
                      mid = special({"<|fim_middle|>", "<fim_middle>"});
            if (pre < 0 || suf < 0 || mid < 0)
                bad("suffix", "body field \"suffix\" needs a fill-in-the-middle model (FIM tokens such as <|fim_prefix|>), and " +
                                  model.source + " has none");
            const std::vector<int> tail = tok->encode(suffix->as_string(), false);
            for (size_t i = 0; i < r.prompts.size(); ++i) {
                std::vector<int> fim = {pre};
                fim.insert(fim.end(), r.prompts[i].begin(), r.prompts[i].end());
                fim.push_back(suf);
                fim.insert(fim.end(), tail.begin(), tail.end());
                fim.push_back(mid);
                r.prompts[i] = std::move(fim);
            }
        }
    }
    r.tokenize_seconds = clock.seconds();

    infer::SamplingParams& p = r.params;
    p.temperature = static_cast<float>(detail::number(body, "temperature", 1.0));
    p.top_p = static_cast<float>(detail::number(body, "top_p", 1.0));
    double top_k = detail::number(body, "top_k", 0);
    p.top_k = top_k < 0 ? 0 : detail::whole(top_k, "top_k", 0, 1e9);  // vLLM's -1 means off, as 0 does here
    p.min_p = static_cast<float>(detail::number(body, "min_p", 0.0));
    p.presence_penalty = static_cast<float>(detail::number(body, "presence_penalty", 0.0));
    p.frequency_penalty = static_cast<float>(detail::number(body, "frequency_penalty", 0.0));
    p.repetition_penalty = static_cast<float>(detail::number(body, "repetition_penalty", 1.0));
    if (const infer::Json* seed = body.find("seed"); seed && !seed->is_null()) {
        if (!seed->is_number() || seed->as_number() != std::floor(seed->as_number()))
            bad("seed", "body field \"seed\" must be an integer");
        p.seed = static_cast<uint64_t>(seed->as_int());
    }
    p.ignore_eos = detail::flag(body, "ignore_eos", false);
    // "logit_bias": {"token id": bias in [-100, 100]}, added to the logits before sampling (-100 bans the token).
    if (const infer::Json* bias = body.find("logit_bias"); bias && !bias->is_null()) {
        if (!bias->is_object()) bad("logit_bias", "body field \"logit_bias\" must be an object of token id → bias");
        for (const auto& [key, value] : bias->as_object()) {
            int id = -1;
            auto [end, error] = std::from_chars(key.data(), key.data() + key.size(), id);
            if (error != std::errc() || end != key.data() + key.size() || id < 0 || id >= model.config.vocab_size)
                bad("logit_bias", infer::concat("logit_bias key \"", key, "\" is not a token id of this vocabulary (", model.config.vocab_size, " tokens)"));
            if (!value.is_number() || !(value.as_number() >= -100 && value.as_number() <= 100))
                bad("logit_bias", infer::concat("logit_bias[\"", key, "\"] must be a number in [-100, 100]"));
            p.logit_bias.emplace_back(id, static_cast<float>(value.as_number()));
        }
    }
    size_t longest_prompt = 0;
    for (const std::vector<int>& prompt : r.prompts) longest_prompt = std::max(longest_prompt, prompt.size());
    const int room = std::max(0, model.config.context_length - static_cast<int>(longest_prompt));
    const char* max_name = body.find("max_completion_tokens") ? "max_completion_tokens" : "max_tokens";
    const double given = detail::number(body, max_name, -1);
    r.max_tokens_given = given >= 0 || (body.find(max_name) && !body.find(max_name)->is_null());
    // Bounded before any arithmetic: no context is longer than 2^24 tokens, and the sums below stay far from overflow.
    p.max_tokens = r.max_tokens_given ? detail::whole(given, max_name, 0, max_generated_tokens) : (chat ? room : 16);
    if (const infer::Json* stop = body.find("stop"); stop && !stop->is_null()) {
        if (stop->is_string()) r.stop.push_back(stop->as_string());
        else if (stop->is_array())
            for (const infer::Json& s : stop->as_array()) {
                if (!s.is_string()) bad("stop", "body field \"stop\" must be a string or an array of strings");
                r.stop.push_back(s.as_string());
            }
        else bad("stop", "body field \"stop\" must be a string or an array of strings");
        for (const std::string& s : r.stop)
            if (s.empty()) bad("stop", "body field \"stop\" holds an empty string");
    }

    // Structured outputs: at most one constraint, from response_format, vLLM's guided_* extras, structured_outputs,
    // or a tool_choice that requires a call.
    std::vector<std::pair<std::string, std::string>> constraints;  // (field, regular expression)
    auto schema_regex = [](const infer::Json& schema, const std::string& field) {
        if (schema.is_string()) return infer::regex_for_json_schema(infer::Json::parse(schema.as_string(), field), field);
        return infer::regex_for_json_schema(schema, field);
    };
    try {
        if (const infer::Json* format = body.find("response_format"); format && !format->is_null()) {
            const infer::Json* type = format->find("type");
            if (!type || !type->is_string()) bad("response_format", "response_format needs a string \"type\"");
            if (type->as_string() == "json_object") {
                constraints.emplace_back("response_format", infer::regex_for_json_object());
            } else if (type->as_string() == "json_schema") {
                const infer::Json* spec = format->find("json_schema");
                const infer::Json* schema = spec ? spec->find("schema") : nullptr;
                if (!schema) bad("response_format", "response_format of type json_schema needs \"json_schema\": {\"name\", \"schema\"}");
                if (const infer::Json* strict = spec->find("strict"); strict && !strict->is_null() && !strict->is_bool())
                    bad("response_format", "response_format.json_schema.strict must be true or false");
                // strict or not, the output follows the schema: a constraint is cheaper than a retry.
                constraints.emplace_back("response_format", schema_regex(*schema, "response_format.json_schema.schema"));
            } else if (type->as_string() != "text") {
                bad("response_format", "response_format.type \"" + type->as_string() + "\" is not one of text, json_object, json_schema");
            }
        }
        if (const infer::Json* schema = body.find("guided_json"); schema && !schema->is_null())
            constraints.emplace_back("guided_json", schema_regex(*schema, "guided_json"));
        if (const infer::Json* regex = body.find("guided_regex"); regex && !regex->is_null()) {
            if (!regex->is_string()) bad("guided_regex", "body field \"guided_regex\" must be a string");
            constraints.emplace_back("guided_regex", regex->as_string());
        }
        auto choices_of = [](const infer::Json& list, const std::string& field) {
            if (!list.is_array() || list.as_array().empty()) bad(field, "\"" + field + "\" must be a non-empty array of strings");
            std::vector<std::string> choices;
            for (const infer::Json& c : list.as_array()) {
                if (!c.is_string()) bad(field, "\"" + field + "\" must be a non-empty array of strings");
                choices.push_back(c.as_string());
            }
            return infer::regex_for_choices(choices);
        };
        if (const infer::Json* choices = body.find("guided_choice"); choices && !choices->is_null())
            constraints.emplace_back("guided_choice", choices_of(*choices, "guided_choice"));
        if (const infer::Json* so = body.find("structured_outputs"); so && !so->is_null()) {
            if (!so->is_object()) bad("structured_outputs", "body field \"structured_outputs\" must be an object");
            for (const auto& [key, value] : so->as_object()) {
                if (value.is_null()) continue;
                if (key == "json") constraints.emplace_back("structured_outputs", schema_regex(value, "structured_outputs.json"));
                else if (key == "regex" && value.is_string()) constraints.emplace_back("structured_outputs", value.as_string());
                else if (key == "choice") constraints.emplace_back("structured_outputs", choices_of(value, "structured_outputs.choice"));
                else if (key == "json_object" && value.is_bool()) {
                    if (value.as_bool()) constraints.emplace_back("structured_outputs", infer::regex_for_json_object());
                } else
                    bad("structured_outputs", "structured_outputs." + key + " is not supported (json, regex, choice, json_object)");
            }
        }
        if (r.tool_choice == ToolChoice::Required)
            constraints.emplace_back("tool_choice", detail::required_tools_regex(r.tools, r.parallel_tool_calls));
        if (r.tool_choice == ToolChoice::Named)
            for (const Tool& t : r.tools)
                if (t.name == r.named_tool)
                    constraints.emplace_back("tool_choice", infer::regex_for_json_schema(t.parameters, "function " + t.name + " parameters"));
    } catch (const HttpError&) {
        throw;
    } catch (const infer::Error& e) {
        bad(constraints.empty() ? "response_format" : constraints.back().first, e.what());
    }
    if (constraints.size() > 1)
        bad(constraints[1].first, infer::concat("\"", constraints[0].first, "\" and \"", constraints[1].first,
                                                "\" both constrain the output; send one"));
    if (!constraints.empty()) {
        const auto& [field, regex] = constraints.front();
        if (!context.grammars) bad(field, "structured outputs are not available here (no tokenizer to match the grammar with)");
        try {
            p.grammar = context.grammars->get(regex, field);
        } catch (const infer::Error& e) {
            bad(field, e.what());
        }
    }

    try {
        p.validate();
    } catch (const infer::Error& e) {  // "invalid sampling parameter NAME = ...": name the field
        std::string message = e.what(), param;
        if (size_t at = message.find("parameter "); at != std::string::npos)
            param = message.substr(at + 10, message.find(' ', at + 10) - at - 10);
        bad(param, message);
    }
    return r;
}

// Whether the request can ever run on an engine with this context and pool (the engine would report it as an error
// event; a server answers 400 before admitting it, as vLLM does). A default max_tokens shrinks to the room left.
inline void check_fits(CompletionRequest& r, int context_length, int pool_tokens) {
    int64_t prompt = 0;  // the longest prompt; sums in 64 bits: none of them can wrap
    for (const std::vector<int>& p : r.prompts) prompt = std::max(prompt, static_cast<int64_t>(p.size()));
    const int64_t limit = std::min(context_length, pool_tokens);
    if (!r.max_tokens_given) r.params.max_tokens = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(r.params.max_tokens, limit - prompt)));
    if (prompt + r.params.max_tokens > context_length)
        throw HttpError(400, infer::concat("This model's maximum context length is ", context_length,
                                                   " tokens. However, you requested ", prompt + r.params.max_tokens,
                                                   " tokens (", prompt, " in the messages, ", r.params.max_tokens,
                                                   " in the completion). Please reduce the length of the messages or completion."),
                        "max_tokens");
    if (prompt + r.params.max_tokens > pool_tokens)
        throw HttpError(400, infer::concat("the prompt (", prompt, " tokens) plus max_tokens (", r.params.max_tokens,
                                                   ") exceed the KV cache of one instance (", pool_tokens, " tokens)"),
                        "max_tokens");
}

// =====================================================================================================================
// Responses — OpenAI's bodies, written by hand (the order of fields is OpenAI's, so a diff against its docs is easy).
// =====================================================================================================================

// The server's timing breakdown of one request, in seconds; sent as "infer_timing" in milliseconds.
struct Timing {
    double http_parse = 0, tokenize = 0, route = 0;          // before the engine: route is the router's choice
    double step_wait = 0;                                    // waiting for the engine loop to end its current step
    infer::RequestBreakdown engine;                          // queue, schedule, prefill, decode, sample, detokenize
    double http_write = 0;                                   // after the engine: writing the response
    double e2e = 0;                                          // arrival to the last byte, measured on its own
    double other() const {
        return std::max(0.0, e2e - http_parse - tokenize - route - step_wait - engine.total() - http_write);
    }
};

inline std::vector<std::pair<const char*, double>> timing_layers(const Timing& t) {
    return {{"http_parse", t.http_parse}, {"tokenize", t.tokenize}, {"route", t.route},
            {"step_wait", t.step_wait},   {"queue", t.engine.queue},    {"schedule", t.engine.schedule},
            {"prefill", t.engine.prefill}, {"decode", t.engine.decode},  {"sample", t.engine.sample},
            {"detokenize", t.engine.detokenize}, {"http_write", t.http_write}, {"other", t.other()}};
}

inline std::string timing_json(const Timing& t) {
    std::ostringstream out;
    out.precision(4);
    out << std::fixed << '{';
    for (const auto& [name, seconds] : timing_layers(t)) out << '"' << name << "_ms\":" << seconds * 1e3 << ',';
    out << "\"e2e_ms\":" << t.e2e * 1e3 << '}';
    return out.str();
}

struct ResponseHead {
    std::string id;       // "cmpl-…" / "chatcmpl-…"
    long long created = 0;
    std::string model;
    bool chat = false;
    const infer::Tokenizer* tokenizer = nullptr;  // spells tokens in "logprobs" ("token_id:N" without one, as vLLM)
};

// A token's text as it reads inside a text, leading space included: decoded after an ordinary token, whose own text is
// then cut off (decoding it alone would drop the leading space that SentencePiece and Llama's decoders strip at the
// start of a text).
inline std::string token_string(const ResponseHead& head, int id) {
    if (!head.tokenizer) return "token_id:" + std::to_string(id);
    const std::vector<int> anchor = head.tokenizer->encode("a", false);
    if (anchor.empty()) return head.tokenizer->decode(std::vector<int>{id});
    const std::string before = head.tokenizer->decode(anchor);
    std::vector<int> ids = anchor;
    ids.push_back(id);
    const std::string both = head.tokenizer->decode(ids);
    return both.compare(0, before.size(), before) == 0 ? both.substr(before.size()) : head.tokenizer->decode(std::vector<int>{id});
}

inline std::string byte_list(std::string_view text) {
    std::string out = "[";
    for (size_t i = 0; i < text.size(); ++i) {
        if (i) out += ',';
        out += std::to_string(static_cast<unsigned char>(text[i]));
    }
    return out + "]";
}

// The "logprobs" field of a choice: null when not asked for. Chat: {"content": [{token, logprob, bytes,
// top_logprobs: [...]}]}. Completions: {tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}, whose
// top entries also hold the sampled token (vLLM's "up to logprobs + 1"). `offset`: where this chunk's text starts.
inline std::string logprobs_json(const ResponseHead& head, std::span<const infer::TokenLogprob> logprobs, bool asked,
                                 size_t offset = 0) {
    if (!asked) return "null";
    auto number = [](float value) { return infer::concat(value); };
    if (head.chat) {
        std::string out = "{\"content\":[";
        for (size_t i = 0; i < logprobs.size(); ++i) {
            const infer::TokenLogprob& lp = logprobs[i];
            const std::string token = token_string(head, lp.id);
            out += std::string(i ? "," : "") + "{\"token\":" + json_string(token) + ",\"logprob\":" + number(lp.logprob) +
                   ",\"bytes\":" + byte_list(token) + ",\"top_logprobs\":[";
            for (size_t k = 0; k < lp.top.size(); ++k) {
                const std::string alternative = token_string(head, lp.top[k].first);
                out += std::string(k ? "," : "") + "{\"token\":" + json_string(alternative) + ",\"logprob\":" +
                       number(lp.top[k].second) + ",\"bytes\":" + byte_list(alternative) + "}";
            }
            out += "]}";
        }
        return out + "]}";
    }
    std::string tokens = "[", values = "[", tops = "[", offsets = "[";
    for (size_t i = 0; i < logprobs.size(); ++i) {
        const infer::TokenLogprob& lp = logprobs[i];
        const std::string token = token_string(head, lp.id);
        const char* comma = i ? "," : "";
        tokens += comma + json_string(token);
        values += comma + number(lp.logprob);
        offsets += comma + std::to_string(offset);
        offset += token.size();
        std::string top = "{";
        bool sampled_listed = false;
        for (const auto& [id, value] : lp.top) {
            top += (top.size() > 1 ? "," : "") + json_string(token_string(head, id)) + ":" + number(value);
            sampled_listed = sampled_listed || id == lp.id;
        }
        if (!sampled_listed) top += (top.size() > 1 ? "," : "") + json_string(token) + ":" + number(lp.logprob);
        tops += comma + top + "}";
    }
    return "{\"tokens\":" + tokens + "],\"token_logprobs\":" + values + "],\"top_logprobs\":" + tops +
           "],\"text_offset\":" + offsets + "]}";
}

// Tokens of one HTTP request: each prompt once, every sample generated (best_of counts all of them, as OpenAI does).
struct Usage {
    size_t prompt = 0, completion = 0, cached = 0;
};

inline std::string usage_json(const Usage& u) {
    return infer::concat("{\"prompt_tokens\":", u.prompt, ",\"completion_tokens\":", u.completion,
                         ",\"total_tokens\":", u.prompt + u.completion,
                         ",\"prompt_tokens_details\":{\"cached_tokens\":", u.cached, "}}");
}

inline std::string head_json(const ResponseHead& head, const char* object) {
    return "\"id\":" + json_string(head.id) + ",\"object\":\"" + object + "\",\"created\":" + std::to_string(head.created) +
           ",\"model\":" + json_string(head.model);
}

// ---- Tool calls out of a reply ------------------------------------------------------------------------------------
// A chat reply with tools becomes content plus tool calls. tool_choice "required" constrained the text to a JSON list
// of {"name", "parameters"}; a named function, to its arguments; "auto" leaves the model free, and its own markup is
// parsed: Hermes/Qwen's <tool_call>{"name", "arguments"}</tool_call> (anywhere, any number), or Llama 3's bare JSON
// {"name", "parameters"} (the whole reply, after an optional <|python_tag|>). While streaming, text that may be the
// start of a call is held back until it is known.

struct ToolCall {
    std::string id, name, arguments;  // arguments: JSON text, as OpenAI sends them
};

// One streamed piece of a call: the first carries its id and name, the rest add to its arguments.
struct ToolCallDelta {
    int index = 0;
    bool first = false;
    std::string id, name, arguments;
};

class ToolCallParser {
public:
    ToolCallParser(ToolChoice choice, std::string named, bool parallel, std::string id_prefix)
        : choice_(choice), named_(std::move(named)), parallel_(parallel), id_prefix_(std::move(id_prefix)) {}

    struct Piece {
        std::string content;
        std::vector<ToolCallDelta> calls;
    };

    Piece push(std::string_view text) {
        Piece out;
        if (choice_ == ToolChoice::None) {
            out.content = text;
            return out;
        }
        if (choice_ == ToolChoice::Named) {  // the text is the arguments: stream them as they come
            if (!named_started_ && !text.empty()) {
                out.calls.push_back({0, true, call_id(0), named_, ""});
                named_started_ = true;
                calls_ = 1;
            }
            if (!text.empty()) out.calls.push_back({0, false, "", "", std::string(text)});
            return out;
        }
        buffer_ += text;
        if (choice_ == ToolChoice::Auto) scan(out, false);
        return out;
    }

    Piece finish() {
        Piece out;
        if (choice_ == ToolChoice::Required) {
            std::optional<infer::Json> list = parse(buffer_);
            if (list && list->is_array())
                for (const infer::Json& call : list->as_array()) add_call(call, "parameters", out);
            if (out.calls.empty()) out.content = buffer_;  // cut short (max_tokens): the text as it is
        } else if (choice_ == ToolChoice::Auto) {
            scan(out, true);
        }
        buffer_.clear();
        return out;
    }

    int calls() const { return calls_; }

    // A whole reply at once (non-streaming): content and calls.
    static std::pair<std::string, std::vector<ToolCall>> split(ToolChoice choice, const std::string& named, bool parallel,
                                                               const std::string& id_prefix, std::string_view text) {
        ToolCallParser parser(choice, named, parallel, id_prefix);
        Piece a = parser.push(text), b = parser.finish();
        std::vector<ToolCall> calls;
        for (const Piece* piece : {&a, &b})
            for (const ToolCallDelta& d : piece->calls) {
                if (d.first) calls.push_back({d.id, d.name, ""});
                if (!calls.empty()) calls.back().arguments += d.arguments;
            }
        return {a.content + b.content, calls};
    }

private:
    static constexpr std::string_view open_tag = "<tool_call>", close_tag = "</tool_call>", python_tag = "<|python_tag|>";

    std::string call_id(int index) const { return "call_" + id_prefix_ + "_" + std::to_string(index); }

    static std::optional<infer::Json> parse(std::string_view text) {
        try {
            return infer::Json::parse(text, "tool call");
        } catch (const infer::Error&) {
            return std::nullopt;
        }
    }

    // {"name": ..., "arguments" | "parameters": ...} → a call (the first only, without parallel_tool_calls).
    bool add_call(const infer::Json& call, const char* arguments_key, Piece& out) {
        const infer::Json* name = call.find("name");
        const infer::Json* arguments = call.find(arguments_key);
        if (!arguments) arguments = call.find(std::string_view(arguments_key) == "parameters" ? "arguments" : "parameters");
        if (!name || !name->is_string()) return false;
        if (!parallel_ && calls_ > 0) return true;  // parsed, and dropped: only one call was asked for
        const std::string text = !arguments ? "{}" : arguments->is_string() ? arguments->as_string() : arguments->dump();
        out.calls.push_back({calls_, true, call_id(calls_), name->as_string(), ""});
        out.calls.push_back({calls_, false, "", "", text});
        ++calls_;
        return true;
    }

    // Auto: move what is known to be content out of the buffer, and calls as they close.
    void scan(Piece& out, bool at_end) {
        if (!decided_) {  // a reply that opens with JSON (or Llama's python tag) may be one bare call: wait for all of it
            const size_t first = buffer_.find_first_not_of(" \t\r\n");
            if (first == std::string::npos && !at_end) return;
            std::string_view rest = first == std::string::npos ? std::string_view() : std::string_view(buffer_).substr(first);
            const bool maybe_tag = rest.size() < python_tag.size() && python_tag.starts_with(rest) && !rest.empty();
            if (!at_end && (maybe_tag || rest.starts_with("{") || rest.starts_with(python_tag))) return;
            if (rest.starts_with(python_tag)) rest.remove_prefix(python_tag.size());
            if (at_end && !rest.empty() && rest.front() == '{') {
                if (std::optional<infer::Json> call = parse(rest); call && call->is_object() && add_call(*call, "parameters", out)) {
                    buffer_.clear();
                    return;
                }
            }
            decided_ = true;
        }
        while (true) {
            if (!in_call_) {
                const size_t open = buffer_.find(open_tag);
                if (open == std::string::npos) {
                    size_t keep = 0;  // the longest tail that may begin a tag
                    for (size_t n = std::min(buffer_.size(), open_tag.size() - 1); n > 0 && !at_end; --n)
                        if (open_tag.starts_with(std::string_view(buffer_).substr(buffer_.size() - n))) {
                            keep = n;
                            break;
                        }
                    out.content += buffer_.substr(0, buffer_.size() - keep);
                    buffer_.erase(0, buffer_.size() - keep);
                    return;
                }
                out.content += buffer_.substr(0, open);
                buffer_.erase(0, open + open_tag.size());
                in_call_ = true;
            }
            const size_t close = buffer_.find(close_tag);
            if (close == std::string::npos && !at_end) return;
            const std::string inside = buffer_.substr(0, close);
            std::optional<infer::Json> call = parse(inside);
            if (!call || !call->is_object() || !add_call(*call, "arguments", out))  // not a call after all: it was text
                out.content += std::string(open_tag) + inside + (close == std::string::npos ? "" : std::string(close_tag));
            buffer_.erase(0, close == std::string::npos ? buffer_.size() : close + close_tag.size());
            in_call_ = false;
            if (buffer_.empty()) return;
        }
    }

    ToolChoice choice_;
    std::string named_;
    bool parallel_;
    std::string id_prefix_;
    std::string buffer_;
    bool decided_ = false, in_call_ = false, named_started_ = false;
    int calls_ = 0;
};

// The deltas of one chunk, one entry per call: a call's opening (id, type, name) and its argument pieces merge.
inline std::string tool_calls_json(std::span<const ToolCallDelta> deltas) {
    std::string out = "[";
    for (size_t i = 0; i < deltas.size();) {
        const ToolCallDelta& head = deltas[i];
        std::string arguments;
        size_t j = i;
        while (j < deltas.size() && deltas[j].index == head.index && (j == i || !deltas[j].first)) arguments += deltas[j++].arguments;
        out += (i ? ",{" : "{") + infer::concat("\"index\":", head.index);
        if (head.first) out += ",\"id\":" + json_string(head.id) + ",\"type\":\"function\",\"function\":{\"name\":" + json_string(head.name) + ",";
        else out += ",\"function\":{";
        out += "\"arguments\":" + json_string(arguments) + "}}";
        i = j;
    }
    return out + "]";
}

// ---- Bodies ---------------------------------------------------------------------------------------------------------

// One choice as it goes out: its text (the prompt first with echo), its tool calls, why it ended.
struct ChoiceOut {
    const infer::RequestResult* result = nullptr;
    std::string text;
    std::vector<ToolCall> tool_calls;
    std::string finish_reason;
    bool logprobs = false;
};

// The whole non-streaming body: the choices, their finish_reason and the usage (plus "infer_timing" when given).
inline std::string completion_body(const ResponseHead& head, std::span<const ChoiceOut> choices, const Usage& usage,
                                   const Timing* timing = nullptr) {
    std::string out = "{" + head_json(head, head.chat ? "chat.completion" : "text_completion") + ",\"choices\":[";
    for (size_t i = 0; i < choices.size(); ++i) {
        const ChoiceOut& c = choices[i];
        out += (i ? ",{\"index\":" : "{\"index\":") + std::to_string(i) + ",";
        if (head.chat) {
            const bool content = !c.text.empty() || c.tool_calls.empty();
            out += "\"message\":{\"role\":\"assistant\",\"content\":" + (content ? json_string(c.text) : std::string("null"));
            if (!c.tool_calls.empty()) {
                out += ",\"tool_calls\":[";
                for (size_t k = 0; k < c.tool_calls.size(); ++k)
                    out += (k ? ",{\"id\":" : "{\"id\":") + json_string(c.tool_calls[k].id) + ",\"type\":\"function\",\"function\":{\"name\":" +
                           json_string(c.tool_calls[k].name) + ",\"arguments\":" + json_string(c.tool_calls[k].arguments) + "}}";
                out += "]";
            }
            out += "}";
        } else {
            out += "\"text\":" + json_string(c.text);
        }
        out += ",\"logprobs\":" + logprobs_json(head, c.result->logprobs, c.logprobs);
        out += ",\"finish_reason\":" + json_string(c.finish_reason) + "}";
    }
    out += "],\"usage\":" + usage_json(usage);
    if (timing) out += ",\"infer_timing\":" + timing_json(*timing);
    return out + "}";
}

// What one streamed chunk carries for one choice.
struct Delta {
    std::string text;                       // content (chat) or text (completions)
    std::vector<ToolCallDelta> tool_calls;  // chat
    bool role = false;                      // the first chat chunk names the assistant role
    std::string logprobs = "null";
    std::string finish_reason;              // "" while the choice goes on
};

// One streamed chunk. With include_usage every chunk carries "usage": null, as OpenAI's.
inline std::string chunk_body(const ResponseHead& head, const Delta& d, int index, bool include_usage) {
    std::string out = "{" + head_json(head, head.chat ? "chat.completion.chunk" : "text_completion") +
                      ",\"choices\":[{\"index\":" + std::to_string(index) + ",";
    if (head.chat) {
        out += std::string("\"delta\":{") + (d.role ? "\"role\":\"assistant\"," : "") + "\"content\":" +
               (d.text.empty() && !d.tool_calls.empty() ? std::string("null") : json_string(d.text));
        if (!d.tool_calls.empty()) out += ",\"tool_calls\":" + tool_calls_json(d.tool_calls);
        out += "}";
    } else {
        out += "\"text\":" + json_string(d.text);
    }
    out += ",\"logprobs\":" + d.logprobs + ",\"finish_reason\":" + (d.finish_reason.empty() ? std::string("null") : json_string(d.finish_reason)) + "}]";
    if (include_usage) out += ",\"usage\":null";
    return out + "}";
}

// The chunk after the last choice chunk when include_usage is set: no choices, the usage (OpenAI's shape).
inline std::string usage_chunk_body(const ResponseHead& head, const Usage& usage) {
    return "{" + head_json(head, head.chat ? "chat.completion.chunk" : "text_completion") +
           ",\"choices\":[],\"usage\":" + usage_json(usage) + "}";
}

// ---- From engine results to choices ---------------------------------------------------------------------------------

// The sum of a sample's token log-probabilities: best_of ranks the samples of one prompt by it.
inline double cumulative_logprob(const infer::RequestResult& result) {
    double sum = 0;
    for (const infer::TokenLogprob& lp : result.logprobs) sum += lp.logprob;
    return sum;
}

// Engine results ([prompt][best_of], in submission order) to the choices of the response ([prompt][n]): per prompt the
// n samples with the highest cumulative logprob (in submission order on ties), echo's prompt text, tool calls.
inline std::vector<ChoiceOut> make_choices(const CompletionRequest& r, std::span<const infer::RequestResult> results,
                                           const std::string& id_prefix) {
    std::vector<ChoiceOut> out;
    const size_t per_prompt = static_cast<size_t>(r.best_of);
    for (size_t p = 0; p * per_prompt < results.size(); ++p) {
        std::vector<size_t> order(per_prompt);
        std::iota(order.begin(), order.end(), p * per_prompt);
        if (r.best_of > r.n)
            std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
                return cumulative_logprob(results[a]) > cumulative_logprob(results[b]);
            });
        for (size_t k = 0; k < static_cast<size_t>(r.n); ++k) {
            const infer::RequestResult& result = results[order[k]];
            ChoiceOut c;
            c.result = &result;
            c.logprobs = r.logprobs_asked;
            c.finish_reason = infer::finish_reason_name(result.finish_reason);
            c.text = (r.echo && p < r.prompt_texts.size() ? r.prompt_texts[p] : std::string()) + result.text;
            if (r.chat && r.tool_choice != ToolChoice::None) {
                auto [content, calls] = ToolCallParser::split(r.tool_choice, r.named_tool, r.parallel_tool_calls,
                                                              id_prefix + "_" + std::to_string(out.size()), result.text);
                c.text = content;
                c.tool_calls = std::move(calls);
                if (!c.tool_calls.empty()) c.finish_reason = "tool_calls";
            }
            out.push_back(std::move(c));
        }
    }
    return out;
}

inline Usage usage_of(const CompletionRequest& r, std::span<const infer::RequestResult> results) {
    Usage u;
    for (const std::vector<int>& prompt : r.prompts) u.prompt += prompt.size();
    for (size_t i = 0; i < results.size(); ++i) {
        u.completion += results[i].generated_ids.size();
        if (i % static_cast<size_t>(r.best_of) == 0) u.cached += static_cast<size_t>(results[i].cached_tokens);
    }
    return u;
}

// Adds "infer_timing" to a chunk or body (an object's text ending in '}').
inline std::string with_timing(std::string body, const Timing& timing) {
    body.pop_back();
    return body + ",\"infer_timing\":" + timing_json(timing) + "}";
}

inline std::string sse(std::string_view data) { return "data: " + std::string(data) + "\n\n"; }

// =====================================================================================================================
// Metrics — counters, gauges and histograms in Prometheus' text exposition format (version 0.0.4), names prefixed
// "infer:" as vLLM's are "vllm:". One mutex: a request touches it a handful of times, a scrape once.
// =====================================================================================================================

class Metrics {
public:
    // Latency buckets in seconds (vLLM's TTFT buckets, which cover CPU and GPU speeds).
    static std::vector<double> latency_buckets() {
        return {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0};
    }

    void add(const std::string& name, const std::string& labels, double value) {
        std::lock_guard lock(mutex_);
        counters_[name][labels] += value;
    }
    void observe(const std::string& name, double value) {
        std::lock_guard lock(mutex_);
        Histogram& h = histograms_[name];
        if (h.counts.empty()) h.counts.assign(latency_buckets().size(), 0);
        const std::vector<double> bounds = latency_buckets();
        for (size_t i = 0; i < bounds.size(); ++i)
            if (value <= bounds[i]) ++h.counts[i];
        ++h.count;
        h.sum += value;
    }
    // Every series carries model_name="NAME" first, as vLLM labels its series.
    void set_model_name(const std::string& name) {
        std::lock_guard lock(mutex_);
        model_label_ = "model_name=" + label_value(name);
    }
    // A label value in the exposition format's quoting: backslash, quote and newline escaped.
    static std::string label_value(std::string_view text) {
        std::string out = "\"";
        for (char c : text) {
            if (c == '\\' || c == '"') out += '\\';
            if (c == '\n') out += "\\n";
            else out += c;
        }
        return out + "\"";
    }

    double counter(const std::string& name, const std::string& labels) const {
        std::lock_guard lock(mutex_);
        auto family = counters_.find(name);
        if (family == counters_.end()) return 0;
        auto found = family->second.find(labels);
        return found == family->second.end() ? 0 : found->second;
    }

    // The exposition: `gauges` (name → labels → value, read at scrape time) first, then counters and histograms.
    // `help` gives each family its # HELP line.
    std::string render(const std::map<std::string, std::map<std::string, double>>& gauges) const {
        std::lock_guard lock(mutex_);
        std::ostringstream out;
        out.precision(10);
        auto family = [&](const std::string& name, const char* type) {
            out << "# HELP " << name << ' ' << help(name) << "\n# TYPE " << name << ' ' << type << '\n';
        };
        auto labelled = [&](const std::string& labels) {
            const std::string all = model_label_ + (model_label_.empty() || labels.empty() ? "" : ",") + labels;
            return all.empty() ? std::string() : "{" + all + "}";
        };
        const std::string model_first = model_label_.empty() ? "" : model_label_ + ",";
        for (const auto& [name, series] : gauges) {
            family(name, name.ends_with("_total") ? "counter" : "gauge");
            for (const auto& [labels, value] : series) out << name << labelled(labels) << ' ' << value << '\n';
        }
        for (const auto& [name, series] : counters_) {
            family(name, "counter");
            for (const auto& [labels, value] : series) out << name << labelled(labels) << ' ' << value << '\n';
        }
        const std::vector<double> bounds = latency_buckets();
        for (const auto& [name, h] : histograms_) {
            family(name, "histogram");
            for (size_t i = 0; i < bounds.size(); ++i)
                out << name << "_bucket{" << model_first << "le=\"" << bounds[i] << "\"} " << h.counts[i] << '\n';
            out << name << "_bucket{" << model_first << "le=\"+Inf\"} " << h.count << '\n' << name << "_sum" << labelled("")
                << ' ' << h.sum << '\n' << name << "_count" << labelled("") << ' ' << h.count << '\n';
        }
        return out.str();
    }

    static std::string help(const std::string& name) {
        static const std::map<std::string, std::string> text = {
            {"infer:http_requests_total", "HTTP requests answered, by endpoint and status code."},
            {"infer:request_success_total", "Requests the engine finished (stop or length), by finish reason."},
            {"infer:request_aborted_total", "Requests that did not finish: cancelled (the client went away) or error."},
            {"infer:prompt_tokens_total", "Prompt tokens of finished requests."},
            {"infer:generation_tokens_total", "Generated tokens of finished requests."},
            {"infer:request_layer_seconds_total", "Seconds spent in each layer, summed over finished requests."},
            {"infer:time_to_first_token_seconds", "Arrival to the first token."},
            {"infer:inter_token_latency_seconds", "Time between consecutive tokens of a request."},
            {"infer:e2e_request_latency_seconds", "Arrival to the last byte of the response."},
            {"infer:request_queue_time_seconds", "Arrival to the first step that scheduled the request."},
            {"infer:num_requests_running", "Requests in the engine's running batch, per instance."},
            {"infer:num_requests_waiting", "Requests in the engine's waiting queue, per instance."},
            {"infer:kv_cache_usage_perc", "Fraction of the KV cache blocks held by requests (0..1), per instance."},
            {"infer:kv_cache_used_blocks", "KV cache blocks held by requests, per instance."},
            {"infer:prefix_cache_hit_ratio", "Prompt tokens found in the prefix cache / prompt tokens, per instance."},
            {"infer:prefix_cache_hits_total", "Prompt tokens found in the prefix cache, per instance."},
            {"infer:prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache, per instance."},
            {"infer:num_preemptions_total", "Sequences preempted for KV room, per instance."},
            {"infer:spec_decode_num_draft_tokens_total", "Speculative tokens proposed and verified, per instance."},
            {"infer:spec_decode_num_accepted_tokens_total", "Speculative tokens the target kept, per instance."},
            {"infer:instance_requests_total", "Requests the router sent to each instance."},
            {"infer:outstanding_tokens", "Prompt plus max_tokens of the requests in flight, per instance."},
            {"infer:upstream_healthy", "1 while an upstream passes its health checks, 0 while ejected."},
            {"infer:upstream_requests_total", "Requests the proxy sent to each upstream."},
        };
        auto found = text.find(name);
        return found == text.end() ? name : found->second;
    }

private:
    struct Histogram {
        std::vector<uint64_t> counts;  // cumulative: counts[i] = observations <= bound i
        uint64_t count = 0;
        double sum = 0;
    };
    mutable std::mutex mutex_;
    std::map<std::string, std::map<std::string, double>> counters_;
    std::map<std::string, Histogram> histograms_;
    std::string model_label_;
};

// The Prometheus text format read back: name{labels} → value (comments skipped). The tests use it; so could a script.
inline std::map<std::string, double> parse_prometheus(std::string_view text) {
    std::map<std::string, double> samples;
    size_t line_number = 0;
    while (!text.empty()) {
        ++line_number;
        size_t end = text.find('\n');
        std::string_view line = text.substr(0, end);
        text = end == std::string_view::npos ? std::string_view() : text.substr(end + 1);
        if (line.empty() || line[0] == '#') continue;
        size_t space = line.rfind(' ');
        if (space == std::string_view::npos) infer::fail("metrics line ", line_number, ": no value: ", line);
        std::string value(line.substr(space + 1));
        size_t used = 0;
        double number = 0;
        try {
            number = value == "+Inf" ? INFINITY : std::stod(value, &used);
            if (value == "+Inf") used = value.size();
        } catch (const std::exception&) {
            used = 0;
        }
        if (used != value.size()) infer::fail("metrics line ", line_number, ": \"", value, "\" is not a number");
        std::string_view name = line.substr(0, space);
        size_t brace = name.find('{');
        std::string_view bare = name.substr(0, brace);
        if (bare.empty() || bare.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_:") != std::string_view::npos)
            infer::fail("metrics line ", line_number, ": \"", bare, "\" is not a metric name");
        if (brace != std::string_view::npos && name.back() != '}')
            infer::fail("metrics line ", line_number, ": unterminated labels");
        samples[std::string(name)] = number;
    }
    return samples;
}

// =====================================================================================================================
// Admission — a bounded waiting queue per instance, in requests and in prompt tokens. Beyond it a request gets 429
// at once (with Retry-After), never a place in a queue it would time out in; a request once admitted always runs to
// its end (or its client's disconnect).
// =====================================================================================================================

struct AdmissionLimits {
    int max_waiting_requests = 64;
    int64_t max_waiting_tokens = 1 << 20;
};

// Whether one more request with `prompt_tokens` fits beside what is waiting now.
inline bool admit(const AdmissionLimits& limits, int waiting_requests, int64_t waiting_tokens, int64_t prompt_tokens) {
    return waiting_requests < limits.max_waiting_requests && waiting_tokens + prompt_tokens <= limits.max_waiting_tokens;
}

// =====================================================================================================================
// Routing — which instance (or upstream) takes a request.
//   round-robin   each in turn: fair in count, blind to cost.
//   least-loaded  the fewest outstanding tokens (prompt + max_tokens of requests in flight): long requests count more.
//   prefix        SGLang's cache-aware policy: while the load is balanced, the instance whose cache holds the longest
//                 prefix of the prompt (if that covers at least cache_threshold of it; else the least loaded); when
//                 the busiest instance has balance_abs more requests than the idlest and balance_rel times as many,
//                 least-loaded, so a popular prefix cannot pile every request onto one instance.
// =====================================================================================================================

enum class RoutePolicy { RoundRobin, LeastLoaded, Prefix };

inline RoutePolicy parse_route_policy(const std::string& name) {
    if (name == "round-robin") return RoutePolicy::RoundRobin;
    if (name == "least-loaded") return RoutePolicy::LeastLoaded;
    if (name == "prefix") return RoutePolicy::Prefix;
    infer::fail("routing policy \"", name, "\" is not one of round-robin, least-loaded, prefix");
}

inline const char* route_policy_name(RoutePolicy policy) {
    return policy == RoutePolicy::RoundRobin ? "round-robin" : policy == RoutePolicy::LeastLoaded ? "least-loaded" : "prefix";
}

// One candidate as the router sees it at the moment of choosing.
struct Candidate {
    bool available = true;          // healthy (the proxy ejects upstreams that fail their checks)
    int64_t requests = 0;           // requests in flight
    int64_t outstanding_tokens = 0; // their prompt + max_tokens
    int64_t prefix_match = 0;       // how much of this prompt its cache holds (tokens in-process, bytes in the proxy)
};

struct RouterConfig {
    RoutePolicy policy = RoutePolicy::RoundRobin;
    double cache_threshold = 0.5;   // SGLang's default
    int64_t balance_abs = 32;       // SGLang's balance_abs_threshold (requests)
    double balance_rel = 1.0001;    // SGLang's balance_rel_threshold
};

class Router {
public:
    explicit Router(RouterConfig config = {}) : config_(config) {}
    const RouterConfig& config() const { return config_; }

    // The index of the chosen candidate, or -1 when none is available. `prompt_size` is in the unit of prefix_match.
    int choose(std::span<const Candidate> candidates, int64_t prompt_size) {
        std::vector<int> up;
        for (size_t i = 0; i < candidates.size(); ++i)
            if (candidates[i].available) up.push_back(static_cast<int>(i));
        if (up.empty()) return -1;
        auto least_loaded = [&] {
            int best = up[0];
            for (int i : up)
                if (candidates[i].outstanding_tokens < candidates[best].outstanding_tokens ||
                    (candidates[i].outstanding_tokens == candidates[best].outstanding_tokens &&
                     candidates[i].requests < candidates[best].requests))
                    best = i;
            return best;
        };
        switch (config_.policy) {
        case RoutePolicy::RoundRobin: return up[next_++ % up.size()];
        case RoutePolicy::LeastLoaded: return least_loaded();
        case RoutePolicy::Prefix: {
            int64_t most = 0, fewest = std::numeric_limits<int64_t>::max();
            for (int i : up) {
                most = std::max(most, candidates[i].requests);
                fewest = std::min(fewest, candidates[i].requests);
            }
            const bool imbalanced = most - fewest > config_.balance_abs &&
                                    static_cast<double>(most) > config_.balance_rel * static_cast<double>(fewest);
            if (imbalanced) return least_loaded();
            int best = up[0];
            for (int i : up)
                if (candidates[i].prefix_match > candidates[best].prefix_match) best = i;
            const double matched = prompt_size > 0 ? static_cast<double>(candidates[best].prefix_match) / static_cast<double>(prompt_size) : 0;
            return matched >= config_.cache_threshold && candidates[best].prefix_match > 0 ? best : least_loaded();
        }
        }
        return up[0];
    }

private:
    RouterConfig config_;
    size_t next_ = 0;
};

// What the proxy knows of an upstream's prefix cache without asking it: the prompts it recently sent there (SGLang
// keeps an approximate radix tree per worker for the same reason). The match is in bytes of prompt text.
class PrefixRecord {
public:
    explicit PrefixRecord(size_t capacity = 256) : capacity_(capacity) {}
    void add(std::string prompt) {
        std::lock_guard lock(mutex_);
        recent_.push_back(std::move(prompt));
        if (recent_.size() > capacity_) recent_.erase(recent_.begin());
    }
    int64_t longest_match(std::string_view prompt) const {
        std::lock_guard lock(mutex_);
        size_t best = 0;
        for (const std::string& seen : recent_) {
            size_t n = 0, limit = std::min(seen.size(), prompt.size());
            while (n < limit && seen[n] == prompt[n]) ++n;
            best = std::max(best, n);
        }
        return static_cast<int64_t>(best);
    }
    void clear() {
        std::lock_guard lock(mutex_);
        recent_.clear();
    }

private:
    size_t capacity_;
    mutable std::mutex mutex_;
    std::vector<std::string> recent_;
};

}  // namespace serve
