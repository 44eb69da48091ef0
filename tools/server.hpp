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
// Requests — an OpenAI /v1/completions or /v1/chat/completions body to an engine request. One implementation for
// `infer serve` and `infer run-batch`. Defaults are OpenAI's: temperature 1, top_p 1, 16 tokens for a completion,
// the rest of the context for a chat reply (as vLLM).
// =====================================================================================================================

inline constexpr int max_choices = 16;  // "n": at most this many choices per request
inline constexpr int max_generated_tokens = 1 << 24;  // "max_tokens": larger than any context, small enough to add

struct CompletionRequest {
    bool chat = false;
    std::string model;                // as the client named it ("" when absent)
    std::vector<int> prompt;
    infer::SamplingParams params;
    std::vector<std::string> stop;
    bool stream = false;
    bool include_usage = false;       // stream_options.include_usage: one more chunk with the usage
    bool max_tokens_given = false;    // false: the default, which the server may shrink to the room left
    int n = 1;                        // choices: n engine requests for the one prompt
    double tokenize_seconds = 0;      // chat template + tokenizer time, for the timing breakdown
};

// What parsing needs from the server: the model (context, vocabulary), its tokenizer and how to render chat messages.
struct RequestContext {
    const infer::Model* model = nullptr;
    const infer::Tokenizer* tokenizer = nullptr;
    std::function<std::string(const infer::Json& messages)> render_chat;  // throws when there is no template
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

}  // namespace detail

inline CompletionRequest parse_request(const infer::Json& body, bool chat, const RequestContext& context) {
    using detail::bad;
    if (!body.is_object()) bad("", "the request body must be a JSON object");
    CompletionRequest r;
    r.chat = chat;
    const infer::Model& model = *context.model;
    if (const infer::Json* m = body.find("model"); m && !m->is_null()) {
        if (!m->is_string()) bad("model", "body field \"model\" must be a string");
        r.model = m->as_string();
    }
    r.n = detail::whole(detail::number(body, "n", 1), "n", 1, max_choices);
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
    r.stream = detail::flag(body, "stream", false);
    if (const infer::Json* options = body.find("stream_options"); options && !options->is_null()) {
        if (!options->is_object()) bad("stream_options", "body field \"stream_options\" must be an object");
        if (!r.stream) bad("stream_options", "body field \"stream_options\" is only allowed when \"stream\" is true");
        r.include_usage = detail::flag(*options, "include_usage", false);
    }

    infer::Stopwatch clock;
    if (chat) {
        const infer::Json* messages = body.find("messages");
        if (!messages || !messages->is_array()) bad("messages", "a chat request's body needs an array field \"messages\"");
        if (messages->as_array().empty()) bad("messages", "body field \"messages\" must not be empty");
        if (!context.tokenizer) bad("messages", model.source + " has no tokenizer to render chat messages with");
        std::string text;
        try {
            text = context.render_chat(*messages);
        } catch (const HttpError&) {
            throw;
        } catch (const infer::Error& e) {
            bad("messages", e.what());
        }
        r.prompt = context.tokenizer->encode(text, false);  // the template writes the special tokens itself
    } else {
        const infer::Json* prompt = body.find("prompt");
        if (!prompt || prompt->is_null()) bad("prompt", "a completion request's body needs a field \"prompt\"");
        if (prompt->is_array() && prompt->as_array().size() == 1 && prompt->as_array()[0].is_string())
            prompt = &prompt->as_array()[0];  // ["text"]: one prompt, as the OpenAI client sends a list of one
        if (prompt->is_string()) {
            if (!context.tokenizer) bad("prompt", model.source + " has no tokenizer: give \"prompt\" as an array of token ids");
            r.prompt = context.tokenizer->encode(prompt->as_string());
        } else if (prompt->is_array() && (prompt->as_array().empty() || prompt->as_array()[0].is_number())) {
            for (const infer::Json& id : prompt->as_array()) {
                if (!id.is_number() || id.as_number() != std::floor(id.as_number()) || id.as_number() < 0 ||
                    id.as_number() >= model.config.vocab_size)
                    bad("prompt", infer::concat("\"prompt\" holds a value that is not a token id of this vocabulary (",
                                                        model.config.vocab_size, " tokens)"));
                r.prompt.push_back(static_cast<int>(id.as_int()));
            }
        } else {
            bad("prompt", "\"prompt\" must be a string or an array of token ids (one prompt per request)");
        }
        if (r.prompt.empty()) bad("prompt", "\"prompt\" is empty: nothing to condition on");
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
    const int room = std::max(0, model.config.context_length - static_cast<int>(r.prompt.size()));
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
    const int64_t prompt = static_cast<int64_t>(r.prompt.size());  // sums in 64 bits: none of them can wrap
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
    double http_parse = 0, tokenize = 0, route = 0;          // before the engine
    infer::RequestBreakdown engine;                          // queue, schedule, prefill, decode, sample, detokenize
    double http_write = 0;                                   // after the engine: writing the response
    double e2e = 0;                                          // arrival to the last byte, measured on its own
    double other() const { return std::max(0.0, e2e - http_parse - tokenize - route - engine.total() - http_write); }
};

inline std::vector<std::pair<const char*, double>> timing_layers(const Timing& t) {
    return {{"http_parse", t.http_parse}, {"tokenize", t.tokenize}, {"route", t.route},
            {"queue", t.engine.queue},    {"schedule", t.engine.schedule}, {"prefill", t.engine.prefill},
            {"decode", t.engine.decode},  {"sample", t.engine.sample}, {"detokenize", t.engine.detokenize},
            {"http_write", t.http_write}, {"other", t.other()}};
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
    for (size_t i = 0; i < text.size(); ++i) out += (i ? "," : "") + std::to_string(static_cast<unsigned char>(text[i]));
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

// The prompt counts once however many choices came from it (OpenAI's usage for n > 1).
inline std::string usage_json(std::span<const infer::RequestResult> results) {
    const size_t prompt = results.front().prompt_ids.size();
    size_t completion = 0;
    for (const infer::RequestResult& r : results) completion += r.generated_ids.size();
    return infer::concat("{\"prompt_tokens\":", prompt, ",\"completion_tokens\":", completion,
                                 ",\"total_tokens\":", prompt + completion,
                                 ",\"prompt_tokens_details\":{\"cached_tokens\":", results.front().cached_tokens, "}}");
}

inline std::string head_json(const ResponseHead& head, const char* object) {
    return "\"id\":" + json_string(head.id) + ",\"object\":\"" + object + "\",\"created\":" + std::to_string(head.created) +
           ",\"model\":" + json_string(head.model);
}

// The whole non-streaming body: one choice, its finish_reason and the usage (plus "infer_timing" when given).
inline std::string completion_body(const ResponseHead& head, std::span<const infer::RequestResult> results,
                                   const Timing* timing = nullptr, bool logprobs = false) {
    std::string out = "{" + head_json(head, head.chat ? "chat.completion" : "text_completion") + ",\"choices\":[";
    for (size_t i = 0; i < results.size(); ++i) {
        const infer::RequestResult& result = results[i];
        out += (i ? ",{\"index\":" : "{\"index\":") + std::to_string(i) + ",";
        if (head.chat) out += "\"message\":{\"role\":\"assistant\",\"content\":" + json_string(result.text) + "}";
        else out += "\"text\":" + json_string(result.text);
        out += ",\"logprobs\":" + logprobs_json(head, result.logprobs, logprobs);
        out += ",\"finish_reason\":\"" + std::string(infer::finish_reason_name(result.finish_reason)) + "\"}";
    }
    out += "],\"usage\":" + usage_json(results);
    if (timing) out += ",\"infer_timing\":" + timing_json(*timing);
    return out + "}";
}

// One streamed chunk: `text` as the choice's delta (chat) or text (completions). `role` adds the assistant role (the
// first chat chunk); `finish_reason` ends the choice. With include_usage every chunk carries "usage": null, as OpenAI's.
inline std::string chunk_body(const ResponseHead& head, std::string_view text, bool role, std::string_view finish_reason,
                              bool include_usage, std::string_view logprobs = "null", int index = 0) {
    std::string out = "{" + head_json(head, head.chat ? "chat.completion.chunk" : "text_completion") +
                      ",\"choices\":[{\"index\":" + std::to_string(index) + ",";
    if (head.chat) out += std::string("\"delta\":{") + (role ? "\"role\":\"assistant\"," : "") + "\"content\":" + json_string(text) + "}";
    else out += "\"text\":" + json_string(text);
    out += ",\"logprobs\":" + std::string(logprobs) + ",\"finish_reason\":" + (finish_reason.empty() ? std::string("null") : json_string(finish_reason)) + "}]";
    if (include_usage) out += ",\"usage\":null";
    return out + "}";
}

// The chunk after the last choice chunk when include_usage is set: no choices, the usage (OpenAI's shape).
inline std::string usage_chunk_body(const ResponseHead& head, std::span<const infer::RequestResult> results) {
    return "{" + head_json(head, head.chat ? "chat.completion.chunk" : "text_completion") +
           ",\"choices\":[],\"usage\":" + usage_json(results) + "}";
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
        auto labelled = [](const std::string& labels) { return labels.empty() ? std::string() : "{" + labels + "}"; };
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
            for (size_t i = 0; i < bounds.size(); ++i) out << name << "_bucket{le=\"" << bounds[i] << "\"} " << h.counts[i] << '\n';
            out << name << "_bucket{le=\"+Inf\"} " << h.count << '\n' << name << "_sum " << h.sum << '\n'
                << name << "_count " << h.count << '\n';
        }
        return out.str();
    }

    static std::string help(const std::string& name) {
        static const std::map<std::string, std::string> text = {
            {"infer:http_requests_total", "HTTP requests answered, by endpoint and status code."},
            {"infer:request_success_total", "Requests the engine finished, by finish reason."},
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
