// serve.cpp — `infer serve`: the OpenAI-compatible HTTP server around one or many engine instances (chapter 08).
//
// A request's path: an HTTP thread of cpp-httplib's pool reads it, parses the JSON and tokenizes (server.hpp), the
// router picks an instance, admission control takes it or answers 429 at once, the instance's EngineLoop thread runs
// it step by step and hands each step's events to the request's Pending box, and the HTTP thread writes them out:
// as SSE chunks when streaming, as one body when not. The HTTP thread polls its socket while it waits, so a client
// that goes away cancels its request within one engine step, and its KV blocks go back to the pool.
#include "infer.hpp"
#include "command_line.hpp"
#include "server.hpp"
#include "http_listen.hpp"

#include <httplib.h>

#include <csignal>
#include <deque>
#include <optional>
#include <iostream>

namespace serve {
namespace {

const char* serve_usage = R"(usage:
  infer serve [-m PATH] [--host 127.0.0.1] [--port 8080] [--instances N] [--route round-robin|least-loaded|prefix]
              [--max-queue N] [--max-queue-tokens N] [--api-key KEY] [--served-model-name NAME] [--max-body BYTES]
              [--chat-template FILE_OR_NAME] [--tokenizer FILE] [-t THREADS] [--http-threads N] [--backlog N]
              [--max-batch-tokens N] [--max-seqs N] [--kv-memory BYTES | --kv-blocks N] [--block-size B]
              [--no-prefix-cache] [--no-mmap] [--spec ngram|draft] [--draft-model PATH] [--spec-k K] [--spec-ngram N]
              [--cache-type f32|f16|bf16]

  OpenAI-compatible endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /v1/models/ID;
  POST /tokenize and /detokenize (vLLM's shapes); GET /health (200 ready, 503 loading or draining), GET /metrics
  (Prometheus text). Structured outputs: response_format json_object/json_schema, guided_json/regex/choice,
  structured_outputs; tools with tool_choice auto, required or a named function.
  Without -m it serves the built-in demo model (random weights). SIGTERM/SIGINT: finish what runs, then exit 0.
  --instances N    N engines in this process sharing the weights, each with its own thread and KV cache
  --max-queue N    requests waiting per instance, beyond its --max-seqs running ones, before 429 (default 64;
                   0: no queue); --max-queue-tokens N: the same bound in prompt tokens (default 1M)
  -t THREADS       matmul threads in all (default: all cores), split between the instances
)";

// One request between the engine's thread (which fills it) and its HTTP thread (which drains it).
struct Pending {
    std::mutex mutex;
    std::condition_variable ready;
    std::deque<infer::Event> events;
    std::map<int, infer::RequestResult> results;  // by engine id, set with each choice's finishing event
};

struct Instance {
    std::unique_ptr<infer::ThreadPool> pool;
    std::unique_ptr<infer::Engine> engine;
    std::unique_ptr<infer::EngineLoop> loop;
    std::atomic<int64_t> requests{0}, outstanding_tokens{0}, waiting_tokens{0};
};

volatile std::sig_atomic_t signalled = 0;
extern "C" void on_signal(int) { signalled = 1; }

long long unix_time() {
    return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

class Server {
public:
    explicit Server(const CommandLine& options) : options_(options) {
        host_ = options.text("--host", "127.0.0.1");
        port_ = static_cast<int>(options.integer("--port", 8080, 0, 65535));
        instance_count_ = static_cast<int>(options.integer("--instances", 1, 1, 256));
        router_ = Router(RouterConfig{.policy = parse_route_policy(options.text("--route", "round-robin"))});
        limits_.max_waiting_requests = static_cast<int>(options.integer("--max-queue", 64, 0, 1 << 20));
        limits_.max_waiting_tokens = options.integer("--max-queue-tokens", 1 << 20, 1, std::numeric_limits<int64_t>::max());
        api_key_ = options.text("--api-key");
        max_body_ = static_cast<size_t>(options.integer("--max-body", 32 << 20, 1, std::numeric_limits<int32_t>::max()));
        http_threads_ = static_cast<int>(options.integer("--http-threads", 64, 1, 4096));
        backlog_ = static_cast<int>(options.integer("--backlog", 1024, 1, 65535));
    }

    int run() {
        std::signal(SIGPIPE, SIG_IGN);
        std::signal(SIGTERM, on_signal);
        std::signal(SIGINT, on_signal);
        routes();
        bind_with_backlog(http_, host_, port_, backlog_, "infer serve");  // bursts wait for a 429, not a reset
        // Listen before loading: while the weights load, /health and the API answer 503 (as vLLM's server does).
        std::thread listener([&] { http_.listen_after_bind(); });
        std::thread watcher([&] { watch_signals(); });
        try {
            load();
        } catch (...) {
            stop_ = true;
            http_.stop();
            listener.join();
            watcher.join();
            throw;
        }
        std::cerr << "infer serve: " << served_name_ << " on http://" << host_ << ':' << port_ << " (" << instance_count_
                  << (instance_count_ == 1 ? " instance" : " instances") << ", route " << route_policy_name(router_.config().policy)
                  << ", max queue " << limits_.max_waiting_requests << ")" << std::endl;
        listener.join();
        watcher.join();
        std::cerr << "infer serve: drained, exiting" << std::endl;
        return 0;
    }

private:
    // ---- startup and shutdown ----------------------------------------------------------------------------------

    void load() {
        if (options_.has("-m")) {
            model_ = model_option(options_);
            served_name_ = std::filesystem::path(options_.text("-m")).filename().string();
        } else {
            model_ = infer::demo_model();
            served_name_ = "infer-demo";
        }
        apply_context_option(model_, options_);
        served_name_ = options_.text("--served-model-name", served_name_);
        if (infer::has_tokenizer(model_)) tokenizer_ = infer::tokenizer_for(model_);
        if (tokenizer_) {
            // A bad --chat-template stops the server; a model without a template serves completions and answers
            // chat requests with a 400 that says how to give one.
            try {
                template_ = chat_template_source(options_.text("--chat-template"), *tokenizer_);
            } catch (const infer::Error& e) {
                if (options_.has("--chat-template")) throw;
                template_error_ = e.what();
            }
            variables_ = template_variables(*tokenizer_);
        }
        context_.model = &model_;
        context_.tokenizer = tokenizer_ ? &*tokenizer_ : nullptr;
        context_.render_chat = [this](const infer::Json& messages, bool add_generation_prompt, const infer::Json& extra) {
            if (!template_error_.empty()) throw HttpError(400, template_error_, "messages");
            return chat::render(template_, messages, add_generation_prompt, merged(variables_, extra));
        };
        grammars_ = std::make_unique<GrammarCache>(context_.tokenizer);
        if (context_.tokenizer) context_.grammars = grammars_.get();
        metrics_.set_model_name(served_name_);

        const infer::EngineConfig config = engine_config(options_);
        const long long threads = options_.integer("-t", 0, 0, 1024);
        const int total = threads > 0 ? static_cast<int>(threads) : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
        // The instances share model_ (the mapped weights, read-only); each has its own pool of threads and KV cache.
        for (int i = 0; i < instance_count_; ++i) {
            auto instance = std::make_unique<Instance>();
            instance->pool = std::make_unique<infer::ThreadPool>(std::max(1, total / instance_count_));
            instance->engine = std::make_unique<infer::Engine>(model_, *instance->pool, config, context_.tokenizer);
            instance->loop = std::make_unique<infer::EngineLoop>(*instance->engine);
            instances_.push_back(std::move(instance));
        }
        pool_tokens_ = instances_[0]->engine->cache().capacity_tokens();
        ready_ = true;
    }

    // SIGTERM/SIGINT: answer 503 to new requests, let the admitted ones finish, then stop listening.
    void watch_signals() {
        while (!stop_ && !signalled) std::this_thread::sleep_for(std::chrono::milliseconds(20));
        if (stop_) return;
        draining_ = true;
        std::cerr << "infer serve: draining " << in_flight_.load() << " requests" << std::endl;
        while (in_flight_ > 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
        http_.stop();  // the instances stop with the Server (http_ goes first: it is declared last)
    }

    // ---- HTTP ---------------------------------------------------------------------------------------------------

    void routes() {
        http_.new_task_queue = [n = http_threads_] { return new httplib::ThreadPool(static_cast<size_t>(n)); };
        http_.set_payload_max_length(max_body_);
        http_.set_keep_alive_timeout(2);
        http_.set_tcp_nodelay(true);  // each SSE chunk leaves at once (Nagle would hold it for the last one's ACK)
        // httplib answers unknown routes (404) and oversized bodies (413) itself; give them OpenAI's error body.
        http_.set_error_handler(httplib::Server::HandlerWithResponse([this](const httplib::Request& req, httplib::Response& res) {
            if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
            std::string message = res.status == 404   ? "Not Found: no route " + req.method + " " + req.path
                                  : res.status == 413 ? infer::concat("the request body is larger than the limit of ",
                                                                              max_body_, " bytes (--max-body)")
                                                      : "HTTP error " + std::to_string(res.status);
            res.set_content(error_body(res.status, message), "application/json");
            count_status(req.path, res.status);
            return httplib::Server::HandlerResponse::Handled;
        }));
        http_.Get("/health", [this](const httplib::Request& req, httplib::Response& res) {
            if (ready_ && !draining_) res.set_content("{\"status\":\"ok\"}", "application/json");
            else fail(req, res, 503, draining_ ? "the server is shutting down" : "the model is loading");
            if (res.status == 200) count_status(req.path, 200);
        });
        http_.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
            res.set_content(render_metrics(), "text/plain; version=0.0.4");
        });
        http_.Get("/v1/models", [this](const httplib::Request& req, httplib::Response& res) {
            if (!gate(req, res)) return;
            res.set_content("{\"object\":\"list\",\"data\":[" + model_object() + "]}", "application/json");
            count_status(req.path, 200);
        });
        http_.Get(R"(/v1/models/(.+))", [this](const httplib::Request& req, httplib::Response& res) {
            if (!gate(req, res)) return;
            if (req.matches[1] != served_name_)
                return fail(req, res, 404, "The model `" + std::string(req.matches[1]) + "` does not exist.", "model");
            res.set_content(model_object(), "application/json");
            count_status(req.path, 200);
        });
        http_.Post("/tokenize", [this](const httplib::Request& req, httplib::Response& res, const httplib::ContentReader& reader) {
            tokenize(req, res, read_body(req, res, reader));
        });
        http_.Post("/detokenize", [this](const httplib::Request& req, httplib::Response& res, const httplib::ContentReader& reader) {
            detokenize(req, res, read_body(req, res, reader));
        });
        http_.Post("/v1/embeddings", [this](const httplib::Request& req, httplib::Response& res, const httplib::ContentReader& reader) {
            if (!read_body(req, res, reader) || !gate(req, res)) return;
            fail(req, res, 400, served_name_ + " is a generative model: this model does not produce embeddings", "model");
        });
        // The API reads its body itself: httplib's own reader refuses a form-encoded body over 8 KB with a 413 (curl -d
        // sends that content type by default), while the body is JSON whatever the client calls it.
        http_.Post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res, const httplib::ContentReader& reader) {
            complete(req, res, read_body(req, res, reader), false);
        });
        http_.Post("/v1/chat/completions", [this](const httplib::Request& req, httplib::Response& res, const httplib::ContentReader& reader) {
            complete(req, res, read_body(req, res, reader), true);
        });
    }

    // The endpoint label comes from a fixed set: a raw path would let a client forge series (a path holding `"` or a
    // newline) or grow /metrics without bound (one series per distinct 404).
    void count_status(const std::string& path, int status) {
        static constexpr std::string_view endpoints[] = {"/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions",
                                                         "/tokenize", "/detokenize", "/v1/embeddings"};
        std::string_view endpoint = path.starts_with("/v1/models/") ? "/v1/models/{id}" : "other";
        for (std::string_view known : endpoints)
            if (path == known) endpoint = known;
        metrics_.add("infer:http_requests_total", infer::concat("endpoint=\"", endpoint, "\",status=\"", status, "\""), 1);
    }

    void fail(const httplib::Request& req, httplib::Response& res, int status, const std::string& message,
              const std::string& param = "") {
        res.status = status;
        if (status == 429) res.set_header("Retry-After", "1");
        res.set_content(error_body(status, message, param), "application/json");
        count_status(req.path, status);
    }

    // The checks every API request passes first: the key (401), then readiness (503).
    bool gate(const httplib::Request& req, httplib::Response& res) {
        if (!api_key_.empty() && req.get_header_value("Authorization") != "Bearer " + api_key_) {
            fail(req, res, 401, req.has_header("Authorization") ? "Incorrect API key provided" : "Missing API key: send \"Authorization: Bearer KEY\"");
            return false;
        }
        if (!ready_ || draining_) {
            fail(req, res, 503, draining_ ? "the server is shutting down" : "the model is loading");
            return false;
        }
        return true;
    }

    // The request body, up to --max-body bytes (httplib answers 413 past it); nullopt after answering a multipart form,
    // which no OpenAI endpoint takes.
    std::optional<std::string> read_body(const httplib::Request& req, httplib::Response& res, const httplib::ContentReader& reader) {
        if (req.is_multipart_form_data()) {
            res.set_header("Connection", "close");  // its body stays unread
            fail(req, res, 415, "the request body must be JSON, not a multipart form (Content-Type: multipart/form-data)");
            return std::nullopt;
        }
        std::string body;
        if (!reader([&](const char* data, size_t length) {
                body.append(data, length);
                return true;
            }))
            return std::nullopt;  // the client went away, or the body passed --max-body: httplib has set the status
        return body;
    }

    std::string model_object() const {
        return "{\"id\":" + json_string(served_name_) + ",\"object\":\"model\",\"created\":" + std::to_string(started_) +
               ",\"owned_by\":\"infer\",\"max_model_len\":" + std::to_string(model_.config.context_length) + "}";
    }

    // The body of /tokenize or /detokenize as JSON, after the gate; nullopt once an error is answered.
    std::optional<infer::Json> json_body(const httplib::Request& req, httplib::Response& res, const std::optional<std::string>& body) {
        if (!body || !gate(req, res)) return std::nullopt;
        try {
            infer::Json json = infer::Json::parse(*body, "request body");
            if (!json.is_object()) throw infer::Error("the request body must be a JSON object");
            if (const infer::Json* m = json.find("model"); m && m->is_string() && m->as_string() != served_name_) {
                fail(req, res, 404, "The model `" + m->as_string() + "` does not exist.", "model");
                return std::nullopt;
            }
            if (!tokenizer_) {
                fail(req, res, 400, served_name_ + " has no tokenizer");
                return std::nullopt;
            }
            return json;
        } catch (const infer::Error& e) {
            fail(req, res, 400, std::string("malformed JSON: ") + e.what());
            return std::nullopt;
        }
    }

    // vLLM's /tokenize: {"prompt", "add_special_tokens": true} or {"messages", "add_generation_prompt": true,
    // "add_special_tokens": false} → {"count", "max_model_len", "tokens"[, "token_strs"]}.
    void tokenize(const httplib::Request& req, httplib::Response& res, const std::optional<std::string>& body) {
        std::optional<infer::Json> json = json_body(req, res, body);
        if (!json) return;
        try {
            for (const auto& [key, _] : json->as_object())
                if (key != "model" && key != "prompt" && key != "messages" && key != "add_special_tokens" &&
                    key != "add_generation_prompt" && key != "return_token_strs" && key != "chat_template_kwargs" &&
                    key != "continue_final_message" && key != "tools")
                    std::cerr << "infer serve: warning: /tokenize: ignoring unknown request field: " << key << std::endl;
            std::vector<int> ids;
            if (json->find("messages")) {
                infer::Json chat_body = *json;  // the chat path renders and encodes exactly as a chat request would
                CompletionRequest r = parse_request(chat_body, true, context_);
                ids = r.prompts.front();
            } else {
                const infer::Json* prompt = json->find("prompt");
                if (!prompt || !prompt->is_string()) throw HttpError(400, "/tokenize needs a string \"prompt\" or \"messages\"", "prompt");
                const infer::Json* add = json->find("add_special_tokens");
                if (add && !add->is_bool()) throw HttpError(400, "\"add_special_tokens\" must be true or false", "add_special_tokens");
                ids = tokenizer_->encode(prompt->as_string(), add ? add->as_bool() : true);
            }
            std::string out = infer::concat("{\"count\":", ids.size(), ",\"max_model_len\":", model_.config.context_length, ",\"tokens\":[");
            for (size_t i = 0; i < ids.size(); ++i) out += (i ? "," : "") + std::to_string(ids[i]);
            out += "]";
            if (const infer::Json* strs = json->find("return_token_strs"); strs && strs->is_bool() && strs->as_bool()) {
                out += ",\"token_strs\":[";
                for (size_t i = 0; i < ids.size(); ++i) out += (i ? "," : "") + json_string(tokenizer_->token_text(ids[i]));
                out += "]";
            }
            res.set_content(out + "}", "application/json");
            count_status(req.path, 200);
        } catch (const HttpError& e) {
            fail(req, res, e.status, e.what(), e.param);
        } catch (const infer::Error& e) {
            fail(req, res, 400, e.what());
        }
    }

    // vLLM's /detokenize: {"tokens": [ids]} → {"prompt": text}.
    void detokenize(const httplib::Request& req, httplib::Response& res, const std::optional<std::string>& body) {
        std::optional<infer::Json> json = json_body(req, res, body);
        if (!json) return;
        const infer::Json* tokens = json->find("tokens");
        if (!tokens || !tokens->is_array()) return fail(req, res, 400, "/detokenize needs an array of token ids \"tokens\"", "tokens");
        std::vector<int> ids;
        for (const infer::Json& id : tokens->as_array()) {
            if (!id.is_number() || id.as_number() != std::floor(id.as_number()) || id.as_number() < 0 ||
                id.as_number() >= tokenizer_->vocab_size())
                return fail(req, res, 400, infer::concat("\"tokens\" holds a value that is not a token id of this vocabulary (",
                                                         tokenizer_->vocab_size(), " tokens)"), "tokens");
            ids.push_back(static_cast<int>(id.as_number()));
        }
        res.set_content("{\"prompt\":" + json_string(tokenizer_->decode(ids)) + "}", "application/json");
        count_status(req.path, 200);
    }

    void complete(const httplib::Request& req, httplib::Response& res, const std::optional<std::string>& request_body, bool chat) {
        if (!request_body) return;
        auto arrival = std::make_shared<infer::Stopwatch>();  // e2e: from here (httplib has read the request) to the last byte
        if (!gate(req, res)) return;
        Timing timing;
        CompletionRequest r;
        infer::Stopwatch clock;
        try {
            infer::Json body;
            try {
                body = infer::Json::parse(*request_body, "request body");
            } catch (const infer::Error& e) {
                throw HttpError(400, std::string("malformed JSON: ") + e.what());
            }
            timing.http_parse = clock.seconds();
            r = parse_request(body, chat, context_);
            timing.tokenize = r.tokenize_seconds;
            if (!r.model.empty() && r.model != served_name_)
                throw HttpError(404, "The model `" + r.model + "` does not exist.", "model");
            check_fits(r, model_.config.context_length, pool_tokens_);
        } catch (const HttpError& e) {
            return fail(req, res, e.status, e.what(), e.param);
        } catch (const infer::Error& e) {
            return fail(req, res, 400, e.what());
        }
        if (!r.ignored_fields.empty()) {  // as vLLM: an unknown field is not an error, but it is said
            std::string names;
            for (const std::string& name : r.ignored_fields) names += (names.empty() ? "" : ", ") + name;
            std::cerr << "infer serve: warning: " << req.path << ": ignoring unknown request field(s): " << names << std::endl;
        }

        // Route, then admit: the instance's queue is checked under its loop's lock, so the bound is exact.
        clock.restart();
        auto pending = std::make_shared<Pending>();
        int64_t prompt_tokens = 0, cost = 0;
        for (const std::vector<int>& prompt : r.prompts) {
            prompt_tokens += static_cast<int64_t>(prompt.size()) * r.best_of;
            cost += (static_cast<int64_t>(prompt.size()) + r.params.max_tokens) * r.best_of;
        }
        int chosen = choose_instance(r.prompts.front());
        timing.route = clock.seconds();
        clock.restart();
        Instance& instance = *instances_[static_cast<size_t>(chosen)];
        infer::EngineLoop* loop = instance.loop.get();
        auto callback = [this, pending, loop](const infer::Event& event) {
            std::optional<infer::RequestResult> result;
            if (event.finished) result = loop->result(event.request_id);  // runs on the loop's thread, outside its lock
            // A cancelled request's HTTP thread is gone (its client hung up): count it here.
            if (event.finished && event.finish_reason == infer::FinishReason::Cancelled)
                metrics_.add("infer:request_aborted_total", "finished_reason=\"cancelled\"", 1);
            std::lock_guard lock(pending->mutex);
            pending->events.push_back(event);
            if (result) pending->results[event.request_id] = std::move(*result);
            pending->ready.notify_all();
        };
        // One engine request per sample: best_of of them per prompt, a seed giving each its own stream.
        auto params_for = [&](int sample) {
            infer::SamplingParams params = r.params;
            if (params.seed) params.seed = *params.seed + static_cast<uint64_t>(sample);
            return params;
        };
        ++in_flight_;
        std::optional<int> id = loop->try_submit(r.prompts.front(), params_for(0), r.stop, callback, [&](const infer::Engine& engine) {
            // The loop's lock is ours once its current step has ended: from now on the request's time is the engine's.
            timing.step_wait = clock.seconds();
            // A request that the next step takes into a free batch slot is not queued; beyond the slots, the queue.
            const int free_slots = std::max(0, engine.config().scheduler.max_seqs - engine.running_count());
            return engine.waiting_count() < free_slots ||
                   admit(limits_, engine.waiting_count() - free_slots, instance.waiting_tokens.load(), prompt_tokens);
        });
        if (!id) {
            --in_flight_;
            return fail(req, res, 429, infer::concat("the server is at capacity: instance ", chosen, " already has ",
                                                             limits_.max_waiting_requests, " requests waiting (--max-queue); retry later"));
        }
        instance.requests += 1;
        instance.outstanding_tokens += cost;
        instance.waiting_tokens += prompt_tokens;
        metrics_.add("infer:instance_requests_total", "instance=\"" + std::to_string(chosen) + "\"", 1);

        auto stream = std::make_shared<Stream>();
        stream->head = ResponseHead{(chat ? "chatcmpl-" : "cmpl-") + std::to_string(chosen) + "-" + std::to_string(*id) + "-" +
                                        std::to_string(next_response_++),
                                    unix_time(), r.model.empty() ? served_name_ : r.model, chat, context_.tokenizer};
        stream->timing = timing;
        stream->arrival = arrival;
        stream->instance = &instance;
        stream->engine_ids.push_back(*id);
        for (size_t prompt = 0; prompt < r.prompts.size(); ++prompt)
            for (int sample = prompt == 0 ? 1 : 0; sample < r.best_of; ++sample)
                stream->engine_ids.push_back(loop->submit(r.prompts[prompt], params_for(sample), r.stop, callback));
        stream->choices.resize(stream->engine_ids.size());
        for (size_t i = 0; i < stream->choices.size(); ++i)
            if (chat && r.tool_choice != ToolChoice::None)
                stream->choices[i].parser.emplace(r.tool_choice, r.named_tool, r.parallel_tool_calls, stream->head.id + "_" + std::to_string(i));
        stream->cost = cost;
        stream->prompt_tokens = prompt_tokens;
        stream->path = req.path;
        const bool streaming = r.stream;
        stream->request = std::move(r);
        res.set_chunked_content_provider(
            streaming ? "text/event-stream" : "application/json",
            [this, pending, stream](size_t, httplib::DataSink& sink) { return write_some(*pending, *stream, sink); },
            [this, stream](bool) { close(*stream); });
        if (streaming) {
            res.set_header("Cache-Control", "no-cache");
            res.set_header("X-Accel-Buffering", "no");  // tell nginx not to buffer the stream
        }
    }

    struct Stream {
        ResponseHead head;
        CompletionRequest request;
        bool waiting = true, done = false, cancelled = false;
        struct Choice {
            bool role_sent = false, echo_sent = false;
            size_t text_offset = 0;  // bytes of token text streamed so far (completions' logprobs.text_offset)
            std::optional<ToolCallParser> parser;  // chat with tools: content and calls apart
            std::optional<infer::RequestResult> result;
        };
        std::vector<Choice> choices;  // one per engine request, in the order of engine_ids
        int finished = 0;             // choices with a result
        Timing timing;
        std::shared_ptr<infer::Stopwatch> arrival;
        double finish_seen = -1;  // arrival-clock seconds when the HTTP thread took the finishing event
        Instance* instance = nullptr;
        std::vector<int> engine_ids;  // [prompt][best_of]
        int64_t cost = 0, prompt_tokens = 0;
        std::string path;
    };

    int choose_instance(const std::vector<int>& prompt) {
        std::vector<Candidate> candidates(instances_.size());
        for (size_t i = 0; i < instances_.size(); ++i) {
            candidates[i].requests = instances_[i]->requests;
            candidates[i].outstanding_tokens = instances_[i]->outstanding_tokens;
            if (router_.config().policy == RoutePolicy::Prefix)
                candidates[i].prefix_match = instances_[i]->loop->inspect(
                    [&](const infer::Engine& engine) { return engine.cache().cached_prefix_tokens(prompt); });
        }
        std::lock_guard lock(router_mutex_);
        return router_.choose(candidates, static_cast<int64_t>(prompt.size()));
    }

    // The content provider: called again and again on the HTTP thread until it returns false or calls sink.done().
    // Each call waits up to 20 ms for events, so a vanished client is noticed (and its request cancelled) within that.
    bool write_some(Pending& pending, Stream& s, httplib::DataSink& sink) {
        std::deque<infer::Event> events;
        {
            std::unique_lock lock(pending.mutex);
            pending.ready.wait_for(lock, std::chrono::milliseconds(20), [&] { return !pending.events.empty(); });
            events.swap(pending.events);
        }
        if (!sink.is_writable()) return cancel(s);
        for (infer::Event& event : events) {
            if (s.waiting) {  // the request left the queue
                s.waiting = false;
                s.instance->waiting_tokens -= s.prompt_tokens;
            }
            const size_t index = static_cast<size_t>(
                std::find(s.engine_ids.begin(), s.engine_ids.end(), event.request_id) - s.engine_ids.begin());
            if (index == s.engine_ids.size()) continue;
            if (!event.finished) {
                if (s.request.stream && !send_chunk(s, sink, event, index, false)) return cancel(s);
                continue;
            }
            {
                std::lock_guard lock(pending.mutex);
                auto found = pending.results.find(event.request_id);
                if (found == pending.results.end()) return cancel(s);
                s.choices[index].result = std::move(found->second);
                pending.results.erase(found);
            }
            if (++s.finished < static_cast<int>(s.choices.size())) {  // another choice still runs: end this one's stream
                if (s.request.stream && s.choices[index].result->finish_reason != infer::FinishReason::Error &&
                    !send_chunk(s, sink, event, index, true))
                    return cancel(s);
                continue;
            }
            s.finish_seen = s.arrival->seconds();
            return finish(s, sink, event, index);
        }
        return true;
    }

    // One streamed chunk for choice `index` from `event` (its text, logprobs; `last`: its finish_reason too). Text
    // goes through the choice's tool-call parser when it has one; echo puts the prompt's text first.
    bool send_chunk(Stream& s, httplib::DataSink& sink, const infer::Event& event, size_t index, bool last,
                    const Timing* timing = nullptr) {
        Stream::Choice& choice = s.choices[index];
        const CompletionRequest& r = s.request;
        Delta d;
        d.text = event.text;
        if (r.echo && !choice.echo_sent) {
            d.text = r.prompt_texts[index / static_cast<size_t>(r.best_of)] + d.text;
            choice.echo_sent = true;
        }
        if (choice.parser) {
            ToolCallParser::Piece piece = choice.parser->push(d.text);
            if (last) {
                ToolCallParser::Piece rest = choice.parser->finish();
                piece.content += rest.content;
                piece.calls.insert(piece.calls.end(), rest.calls.begin(), rest.calls.end());
            }
            d.text = std::move(piece.content);
            d.tool_calls = std::move(piece.calls);
        }
        const bool logprobs = r.logprobs_asked && !event.logprobs.empty();
        if (!last && d.text.empty() && d.tool_calls.empty() && !logprobs) return true;  // nothing to say yet
        d.logprobs = logprobs_json(s.head, event.logprobs, r.logprobs_asked, choice.text_offset);
        for (const infer::TokenLogprob& lp : event.logprobs) choice.text_offset += token_string(s.head, lp.id).size();
        d.role = s.head.chat && !choice.role_sent;
        choice.role_sent = true;
        if (last) {
            d.finish_reason = infer::finish_reason_name(choice.result->finish_reason);
            if (choice.parser && choice.parser->calls() > 0) d.finish_reason = "tool_calls";
        }
        std::string chunk = chunk_body(s.head, d, static_cast<int>(index), r.include_usage);
        if (timing) chunk = with_timing(chunk, *timing);
        std::string data = sse(chunk);
        return sink.write(data.data(), data.size());
    }

    // Every choice has its result; `event` finished the last of them, choice `index`.
    bool finish(Stream& s, httplib::DataSink& sink, const infer::Event& event, size_t index) {
        std::vector<infer::RequestResult> results;
        for (Stream::Choice& choice : s.choices) results.push_back(*choice.result);
        const infer::RequestResult& last = results[index];
        const infer::RequestResult* failed = nullptr;
        for (const infer::RequestResult& result : results)
            if (result.finish_reason == infer::FinishReason::Error) failed = &result;
        Timing& t = s.timing;
        t.engine = last.times.breakdown;
        t.http_write = s.arrival->seconds() - s.finish_seen;
        t.e2e = s.arrival->seconds();
        const Usage usage = usage_of(s.request, results);
        // Counted before the last write, so a client that has its last byte finds its request in /metrics.
        record(s, results, usage);
        bool ok = true;
        if (s.request.stream) {
            if (failed) {
                std::string data = sse(error_body(500, failed->error));
                ok = sink.write(data.data(), data.size());
            } else {
                ok = send_chunk(s, sink, event, index, true, s.request.include_usage ? nullptr : &t);
                if (ok && s.request.include_usage) {
                    std::string data = sse(with_timing(usage_chunk_body(s.head, usage), t));
                    ok = sink.write(data.data(), data.size());
                }
            }
            if (ok) ok = sink.write("data: [DONE]\n\n", 14);
        } else {
            std::string body = failed ? error_body(500, failed->error)
                                      : completion_body(s.head, make_choices(s.request, results, s.head.id), usage, &t);
            ok = sink.write(body.data(), body.size());
        }
        if (ok) sink.done();
        s.done = true;
        return ok;
    }

    // The client went away: cancel the request (its blocks go back at the next step) and stop writing.
    bool cancel(Stream& s) {
        if (!s.done && !s.cancelled) {
            s.cancelled = true;
            for (int id : s.engine_ids) s.instance->loop->cancel(id);
        }
        return false;
    }

    // After the last write (or the connection's end): the request no longer counts against its instance or the drain.
    void close(Stream& s) {
        if (!s.done) cancel(s);
        if (s.waiting) s.instance->waiting_tokens -= s.prompt_tokens;
        s.waiting = false;
        s.instance->requests -= 1;
        s.instance->outstanding_tokens -= s.cost;
        if (!s.done) count_status(s.path, 499);  // nginx's "client closed request"
        --in_flight_;
    }

    // One HTTP request with its engine requests' results. Finished ones (stop, length) count as successes, by reason;
    // failed ones apart, as aborted.
    void record(const Stream& s, std::span<const infer::RequestResult> results, const Usage& usage) {
        count_status(s.path, 200);  // the status line went out with the first byte
        metrics_.add("infer:prompt_tokens_total", "", static_cast<double>(usage.prompt));
        for (const auto& [layer, seconds] : timing_layers(s.timing))
            metrics_.add("infer:request_layer_seconds_total", std::string("layer=\"") + layer + "\"", seconds);
        const double before_engine = s.timing.http_parse + s.timing.tokenize + s.timing.route + s.timing.step_wait;
        for (const infer::RequestResult& result : results) {
            const std::string reason = infer::finish_reason_name(result.finish_reason);
            if (result.finish_reason == infer::FinishReason::Stop || result.finish_reason == infer::FinishReason::Length)
                metrics_.add("infer:request_success_total", "finished_reason=\"" + reason + "\"", 1);
            else if (result.finish_reason == infer::FinishReason::Error)  // cancelled ones are counted as they happen
                metrics_.add("infer:request_aborted_total", "finished_reason=\"" + reason + "\"", 1);
            metrics_.add("infer:generation_tokens_total", "", static_cast<double>(result.generated_ids.size()));
            const infer::RequestTimes& t = result.times;
            if (t.first_token >= 0) metrics_.observe("infer:time_to_first_token_seconds", before_engine + t.first_token - t.arrival);
            for (size_t i = 1; i < t.token_times.size(); ++i)
                metrics_.observe("infer:inter_token_latency_seconds", t.token_times[i] - t.token_times[i - 1]);
            if (t.first_scheduled >= 0) metrics_.observe("infer:request_queue_time_seconds", t.first_scheduled - t.arrival);
        }
        metrics_.observe("infer:e2e_request_latency_seconds", s.timing.e2e);
    }

    std::string render_metrics() {
        std::map<std::string, std::map<std::string, double>> gauges;
        if (ready_)
            for (size_t i = 0; i < instances_.size(); ++i) {
                const std::string label = "instance=\"" + std::to_string(i) + "\"";
                instances_[i]->loop->inspect([&](const infer::Engine& engine) {
                    const infer::KVCache& cache = engine.cache();
                    const infer::EngineTotals& totals = engine.totals();
                    gauges["infer:num_requests_running"][label] = engine.running_count();
                    gauges["infer:num_requests_waiting"][label] = engine.waiting_count();
                    gauges["infer:kv_cache_used_blocks"][label] = cache.used_block_count();
                    gauges["infer:kv_cache_usage_perc"][label] = static_cast<double>(cache.used_block_count()) / cache.num_blocks();
                    gauges["infer:prefix_cache_hits_total"][label] = static_cast<double>(totals.prefix_hit_tokens);
                    gauges["infer:prefix_cache_queries_total"][label] = static_cast<double>(totals.prompt_tokens);
                    gauges["infer:prefix_cache_hit_ratio"][label] =
                        totals.prompt_tokens > 0 ? static_cast<double>(totals.prefix_hit_tokens) / static_cast<double>(totals.prompt_tokens) : 0;
                    gauges["infer:num_preemptions_total"][label] = static_cast<double>(totals.preemptions);
                    gauges["infer:spec_decode_num_draft_tokens_total"][label] = static_cast<double>(totals.draft_tokens);
                    gauges["infer:spec_decode_num_accepted_tokens_total"][label] = static_cast<double>(totals.accepted_tokens);
                    return 0;
                });
                gauges["infer:outstanding_tokens"][label] = static_cast<double>(instances_[i]->outstanding_tokens.load());
            }
        return metrics_.render(gauges);
    }

    const CommandLine& options_;
    std::string host_, api_key_, served_name_, template_, template_error_;
    int port_ = 8080, instance_count_ = 1, http_threads_ = 64, backlog_ = 1024, pool_tokens_ = 0;
    size_t max_body_ = 0;
    AdmissionLimits limits_;
    Router router_;
    std::mutex router_mutex_;
    infer::Model model_;
    std::optional<infer::Tokenizer> tokenizer_;
    infer::Json variables_;
    RequestContext context_;
    std::unique_ptr<GrammarCache> grammars_;
    std::vector<std::unique_ptr<Instance>> instances_;
    Metrics metrics_;
    std::atomic<bool> ready_{false}, draining_{false}, stop_{false};
    std::atomic<int> in_flight_{0};
    std::atomic<long long> next_response_{0};
    long long started_ = unix_time();
    httplib::Server http_;
};

}  // namespace
}  // namespace serve

// Called by main.cpp's main for `infer serve ...`.
int run_serve(int argc, char** argv) {
    CommandLine options(argc, argv, 2,
                        {"-m", "--host", "--port", "--instances", "--route", "--max-queue", "--max-queue-tokens", "--api-key",
                         "--served-model-name", "--max-body", "--chat-template", "--tokenizer", "-t", "--http-threads", "--backlog",
                         "--max-batch-tokens", "--max-seqs", "--kv-memory", "--kv-blocks", "--block-size", "-c", "--spec",
                         "--draft-model", "--spec-k", "--spec-ngram", "--cache-type", "--cache-type-k", "--cache-type-v"},
                        {"--no-prefix-cache", "--no-mmap"}, serve::serve_usage);
    serve::Server server(options);
    return server.run();
}
