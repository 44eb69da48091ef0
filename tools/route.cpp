// route.cpp — `infer route`: the router of server.hpp as its own process, in front of several `infer serve`
// processes (chapter 09). It reads just enough of each body to route it (the prompt, for the prefix policy; max_tokens,
// for the load), forwards it unchanged and passes the answer back byte for byte as it arrives, so streams stay
// streams. A health checker asks each upstream's /health; one that fails is ejected, one that answers again is
// readmitted. A request whose upstream cannot be reached before anything was sent goes to the next one.
#include "infer.hpp"
#include "command_line.hpp"
#include "server.hpp"
#include "http_listen.hpp"

#include <httplib.h>
#include <nlohmann/json.hpp>

#include <csignal>
#include <deque>
#include <iostream>

namespace serve {
namespace {

const char* route_usage = R"(usage:
  infer route --port P --upstream URL [--upstream URL ...] [--host 127.0.0.1] [--policy round-robin|least-loaded|prefix]
              [--health-interval SECONDS] [--http-threads N] [--backlog N] [--upstream-timeout SECONDS]
              [--served-model-name NAME]

  Forwards /v1/completions, /v1/chat/completions, /v1/models[/ID], /tokenize, /detokenize and /v1/embeddings to the
  upstream `infer serve` processes (URL like http://127.0.0.1:8081), streams passed through. GET /health: 200 while
  an upstream is healthy. GET /metrics: the proxy's own (upstream health, requests per upstream), labelled
  model_name="NAME" (default: infer).
)";

struct Upstream {
    std::string url, host;
    int port = 0;
    std::atomic<bool> healthy{true};
    std::atomic<int64_t> requests{0}, outstanding_tokens{0};
    PrefixRecord record;
};

// One forwarded exchange: the upstream's thread fills it, the downstream HTTP thread drains it.
struct Relay {
    std::mutex mutex;
    std::condition_variable ready;
    bool have_head = false, done = false, downstream_gone = false;
    httplib::Error error = httplib::Error::Success;  // how the upstream exchange ended
    bool timed_out = false;                          // ended by --upstream-timeout
    int status = 0;
    httplib::Headers headers;
    std::deque<std::string> chunks;
    std::unique_ptr<httplib::Client> client;
    std::thread thread;
    ~Relay() {  // the last owner may be the upstream thread itself, which cannot join itself
        if (thread.joinable()) thread.get_id() == std::this_thread::get_id() ? thread.detach() : thread.join();
    }
};

volatile std::sig_atomic_t route_signalled = 0;
extern "C" void on_route_signal(int) { route_signalled = 1; }

class Proxy {
public:
    Proxy(const CommandLine& options, const std::vector<std::string>& upstreams) {
        host_ = options.text("--host", "127.0.0.1");
        port_ = static_cast<int>(options.integer("--port", 8000, 0, 65535));
        router_ = Router(RouterConfig{.policy = parse_route_policy(options.text("--policy", "round-robin"))});
        interval_ = options.number("--health-interval", 1.0);
        if (!(interval_ > 0)) infer::fail("option --health-interval: must be > 0 seconds");
        http_threads_ = static_cast<int>(options.integer("--http-threads", 64, 1, 4096));
        backlog_ = static_cast<int>(options.integer("--backlog", 1024, 1, 65535));
        metrics_.set_model_name(options.text("--served-model-name", "infer"));
        upstream_timeout_ = options.number("--upstream-timeout", 600);
        if (!(upstream_timeout_ > 0)) infer::fail("option --upstream-timeout: must be > 0 seconds");
        if (upstreams.empty()) infer::fail("infer route needs at least one --upstream URL");
        for (const std::string& url : upstreams) {
            auto upstream = std::make_unique<Upstream>();
            upstream->url = url;
            std::string rest = url;
            if (rest.starts_with("http://")) rest = rest.substr(7);
            else if (rest.find("://") != std::string::npos)
                infer::fail("--upstream ", url, ": only http:// upstreams are supported");
            while (!rest.empty() && rest.back() == '/') rest.pop_back();
            size_t colon = rest.rfind(':');
            if (colon == std::string::npos) infer::fail("--upstream ", url, ": needs a port, like http://127.0.0.1:8081");
            upstream->host = rest.substr(0, colon);
            try {
                upstream->port = std::stoi(rest.substr(colon + 1));
            } catch (const std::exception&) {
                infer::fail("--upstream ", url, ": \"", rest.substr(colon + 1), "\" is not a port");
            }
            upstreams_.push_back(std::move(upstream));
        }
    }

    int run() {
        std::signal(SIGPIPE, SIG_IGN);
        std::signal(SIGTERM, on_route_signal);
        std::signal(SIGINT, on_route_signal);
        routes();
        bind_with_backlog(http_, host_, port_, backlog_, "infer route");
        std::thread checker([&] { check_health(); });
        std::cerr << "infer route: http://" << host_ << ':' << port_ << " -> " << upstreams_.size() << " upstreams, policy "
                  << route_policy_name(router_.config().policy) << std::endl;
        http_.listen_after_bind();
        stop_ = true;
        checker.join();
        return 0;
    }

private:
    void check_health() {
        auto last = std::chrono::steady_clock::now() - std::chrono::hours(1);
        while (!stop_) {
            if (route_signalled) {
                http_.stop();
                return;
            }
            if (std::chrono::steady_clock::now() - last >= std::chrono::duration<double>(interval_)) {
                last = std::chrono::steady_clock::now();
                for (auto& upstream : upstreams_) {
                    httplib::Client client(upstream->host, upstream->port);
                    client.set_connection_timeout(1);
                    client.set_read_timeout(2);
                    auto answer = client.Get("/health");
                    const bool ok = answer && answer->status == 200;
                    if (ok != upstream->healthy.exchange(ok)) {
                        std::cerr << "infer route: " << upstream->url << (ok ? " readmitted" : " ejected") << std::endl;
                        if (!ok) upstream->record.clear();  // its cache is gone (or soon will be)
                    }
                }
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
    }

    void routes() {
        http_.new_task_queue = [n = http_threads_] { return new httplib::ThreadPool(static_cast<size_t>(n)); };
        http_.set_keep_alive_timeout(2);
        http_.set_tcp_nodelay(true);  // each SSE chunk leaves at once (Nagle would hold it for the last one's ACK)
        http_.set_error_handler(httplib::Server::HandlerWithResponse([this](const httplib::Request& req, httplib::Response& res) {
            if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
            res.set_content(error_body(res.status, res.status == 404 ? "Not Found: no route " + req.method + " " + req.path
                                                                     : "HTTP error " + std::to_string(res.status)),
                            "application/json");
            return httplib::Server::HandlerResponse::Handled;
        }));
        http_.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
            for (auto& upstream : upstreams_)
                if (upstream->healthy) return res.set_content("{\"status\":\"ok\"}", "application/json");
            res.status = 503;
            res.set_content(error_body(503, "no healthy upstream"), "application/json");
        });
        http_.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
            std::map<std::string, std::map<std::string, double>> gauges;
            for (auto& upstream : upstreams_) {
                const std::string label = "upstream=\"" + upstream->url + "\"";
                gauges["infer:upstream_healthy"][label] = upstream->healthy ? 1 : 0;
                gauges["infer:outstanding_tokens"][label] = static_cast<double>(upstream->outstanding_tokens.load());
            }
            res.set_content(metrics_.render(gauges), "text/plain; version=0.0.4");
        });
        auto forward = [this](const httplib::Request& req, httplib::Response& res) { this->forward(req, req.body, res); };
        // POST bodies are read here, whatever their content type (httplib's own reader stops a form-encoded one at 8 KB).
        auto forward_body = [this](const httplib::Request& req, httplib::Response& res, const httplib::ContentReader& reader) {
            std::string body;
            if (req.is_multipart_form_data()) {
                res.status = 415;
                res.set_header("Connection", "close");
                return res.set_content(error_body(415, "the request body must be JSON, not a multipart form"), "application/json");
            }
            bool complete = reader([&](const char* data, size_t length) {
                body.append(data, length);
                return true;
            });
            if (complete) this->forward(req, body, res);
        };
        http_.Get("/v1/models", forward);
        http_.Get(R"(/v1/models/(.+))", forward);
        for (const char* path : {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/v1/embeddings"})
            http_.Post(path, forward_body);
    }

    // What routing needs from a body: the prompt's text (prefix policy) and its cost estimate (least-loaded).
    static std::pair<std::string, int64_t> routing_key(const std::string& body) {
        nlohmann::json json = nlohmann::json::parse(body, nullptr, false);
        if (json.is_discarded() || !json.is_object()) return {"", 0};
        std::string text;
        if (json.contains("prompt") && json["prompt"].is_string()) text = json["prompt"].get<std::string>();
        if (json.contains("messages") && json["messages"].is_array())
            for (const auto& message : json["messages"])
                if (message.is_object() && message.contains("content") && message["content"].is_string())
                    text += message.value("role", "") + ": " + message["content"].get<std::string>() + "\n";
        int64_t max_tokens = 16;
        for (const char* name : {"max_tokens", "max_completion_tokens"})
            if (json.contains(name) && json[name].is_number_integer()) max_tokens = json[name].get<int64_t>();
        return {text, static_cast<int64_t>(text.size() / 4) + max_tokens};  // ~4 bytes a token: an estimate suffices
    }

    void forward(const httplib::Request& req, const std::string& body, httplib::Response& res) {
        auto [text, cost] = req.method == "POST" ? routing_key(body) : std::pair<std::string, int64_t>{"", 0};
        std::string last_failure;  // why the last upstream tried could not be reached
        std::vector<bool> tried(upstreams_.size(), false);
        while (true) {
            std::vector<Candidate> candidates(upstreams_.size());
            for (size_t i = 0; i < upstreams_.size(); ++i) {
                candidates[i].available = upstreams_[i]->healthy && !tried[i];
                candidates[i].requests = upstreams_[i]->requests;
                candidates[i].outstanding_tokens = upstreams_[i]->outstanding_tokens;
                if (router_.config().policy == RoutePolicy::Prefix) candidates[i].prefix_match = upstreams_[i]->record.longest_match(text);
            }
            int chosen;
            {
                std::lock_guard lock(router_mutex_);
                chosen = router_.choose(candidates, static_cast<int64_t>(text.size()));
            }
            if (chosen < 0) {  // 502 when upstreams were tried and failed; 503 when none was healthy to begin with
                res.status = last_failure.empty() ? 503 : 502;
                res.set_content(error_body(res.status, last_failure.empty() ? "no healthy upstream to serve the request" : last_failure),
                                "application/json");
                return;
            }
            tried[static_cast<size_t>(chosen)] = true;
            if (relay(req, body, res, *upstreams_[static_cast<size_t>(chosen)], text, cost, last_failure)) return;
        }
    }

    // Sends the request to one upstream. False: it could not be reached (it is ejected, `failure` says why, and the
    // caller tries another). Once the upstream has accepted the request it is never retried elsewhere (it may have
    // run): a failure then is the client's 502 (connection lost) or 504 (--upstream-timeout passed).
    bool relay(const httplib::Request& req, const std::string& body, httplib::Response& res, Upstream& upstream,
               const std::string& text, int64_t cost, std::string& failure) {
        auto r = std::make_shared<Relay>();
        r->client = std::make_unique<httplib::Client>(upstream.host, upstream.port);
        r->client->set_connection_timeout(2);
        const auto timeout = std::chrono::duration<double>(upstream_timeout_);
        r->client->set_read_timeout(std::chrono::duration_cast<std::chrono::microseconds>(timeout));
        auto outgoing = std::make_shared<httplib::Request>();
        outgoing->method = req.method;
        outgoing->path = req.path;
        outgoing->body = body;
        for (const char* name : {"Authorization", "Content-Type", "Accept"})
            if (req.has_header(name)) outgoing->headers.emplace(name, req.get_header_value(name));
        outgoing->response_handler = [r](const httplib::Response& head) {
            std::lock_guard lock(r->mutex);
            r->status = head.status;
            r->headers = head.headers;
            r->have_head = true;
            r->ready.notify_all();
            return !r->downstream_gone;
        };
        outgoing->content_receiver = [r](const char* data, size_t size, uint64_t, uint64_t) {
            std::lock_guard lock(r->mutex);
            r->chunks.emplace_back(data, size);
            r->ready.notify_all();
            return !r->downstream_gone;
        };
        r->thread = std::thread([r, outgoing, timeout] {
            httplib::Response answer;
            httplib::Error error = httplib::Error::Success;
            const auto start = std::chrono::steady_clock::now();
            r->client->send(*outgoing, answer, error);
            std::lock_guard lock(r->mutex);
            r->error = error;
            r->timed_out = error == httplib::Error::Read && std::chrono::steady_clock::now() - start >= timeout * 0.99;
            r->done = true;
            r->ready.notify_all();
        });
        {
            std::unique_lock lock(r->mutex);
            r->ready.wait(lock, [&] { return r->have_head || r->done; });
            if (!r->have_head) {
                const std::string why = httplib::to_string(r->error);
                if (r->error == httplib::Error::Connection) {  // never reached: eject it now rather than at the next check
                    lock.unlock();
                    if (upstream.healthy.exchange(false)) std::cerr << "infer route: " << upstream.url << " ejected (unreachable)" << std::endl;
                    failure = "upstream " + upstream.url + " could not be reached: " + why;
                    return false;
                }
                res.status = r->timed_out ? 504 : 502;
                res.set_content(error_body(res.status, r->timed_out ? infer::concat("upstream ", upstream.url, " did not answer within ",
                                                                                    upstream_timeout_, " s (--upstream-timeout)")
                                                                    : "upstream " + upstream.url + " failed before answering: " + why),
                                "application/json");
                return true;
            }
        }
        upstream.requests += 1;
        upstream.outstanding_tokens += cost;
        if (!text.empty()) upstream.record.add(text);
        metrics_.add("infer:upstream_requests_total", "upstream=\"" + upstream.url + "\"", 1);
        res.status = r->status;
        std::string content_type = "application/json";
        for (const auto& [name, value] : r->headers) {
            if (name == "Content-Type") content_type = value;
            else if (name == "Retry-After" || name == "Cache-Control" || name == "X-Accel-Buffering") res.set_header(name.c_str(), value);
        }
        // Anything but an event stream (a JSON answer, an error body) is relayed whole: its status can still change to
        // 502/504 if the upstream fails before its last byte, and an upstream's error body reaches the client as sent.
        if (content_type.find("text/event-stream") == std::string::npos) {
            std::unique_lock lock(r->mutex);
            r->ready.wait(lock, [&] { return r->done; });
            std::string whole;
            for (const std::string& chunk : r->chunks) whole += chunk;
            upstream.requests -= 1;
            upstream.outstanding_tokens -= cost;
            if (r->error != httplib::Error::Success) {
                res.status = r->timed_out ? 504 : 502;
                res.set_content(error_body(res.status, "upstream " + upstream.url + " failed mid-response: " + httplib::to_string(r->error)),
                                "application/json");
                return true;
            }
            res.set_content(whole, content_type);
            return true;
        }
        // An event stream passes through as it comes. If the upstream fails mid-stream the client gets an error event
        // and the connection closes without `data: [DONE]`, so it cannot take a truncated answer for a whole one.
        res.set_chunked_content_provider(
            content_type,
            [r, url = upstream.url](size_t, httplib::DataSink& sink) {
                std::deque<std::string> chunks;
                bool done;
                httplib::Error error;
                {
                    std::unique_lock lock(r->mutex);
                    r->ready.wait_for(lock, std::chrono::milliseconds(20), [&] { return !r->chunks.empty() || r->done; });
                    chunks.swap(r->chunks);
                    done = r->done;
                    error = r->error;
                }
                for (const std::string& chunk : chunks)
                    if (!sink.write(chunk.data(), chunk.size())) return false;
                if (!sink.is_writable()) return false;
                if (done && error != httplib::Error::Success) {
                    const int status = r->timed_out ? 504 : 502;
                    const std::string event = "data: " + error_body(status, "upstream " + url + " failed mid-stream: " +
                                                                                httplib::to_string(error)) + "\n\n";
                    sink.write(event.data(), event.size());
                    return false;  // no terminating chunk: the response is visibly incomplete
                }
                if (done) sink.done();
                return true;
            },
            [r, &upstream, cost](bool) {
                {
                    std::lock_guard lock(r->mutex);
                    r->downstream_gone = true;  // the upstream's next callback returns false: its request is cancelled
                }
                r->client->stop();
                upstream.requests -= 1;
                upstream.outstanding_tokens -= cost;
            });
        return true;
    }

    std::string host_;
    int port_ = 8000, http_threads_ = 64, backlog_ = 1024;
    double interval_ = 1.0, upstream_timeout_ = 600;
    std::vector<std::unique_ptr<Upstream>> upstreams_;
    Router router_;
    std::mutex router_mutex_;
    Metrics metrics_;
    std::atomic<bool> stop_{false};
    httplib::Server http_;
};

}  // namespace
}  // namespace serve

// Called by main.cpp's main for `infer route ...`. --upstream repeats, so it is taken out before the option parser.
int run_route(int argc, char** argv) {
    std::vector<std::string> upstreams;
    std::vector<char*> rest(argv, argv + 2);
    for (int i = 2; i < argc; ++i) {
        if (std::string(argv[i]) == "--upstream") {
            if (i + 1 >= argc) infer::fail("option --upstream needs a value");
            upstreams.push_back(argv[++i]);
        } else {
            rest.push_back(argv[i]);
        }
    }
    CommandLine options(static_cast<int>(rest.size()), rest.data(), 2,
                        {"--port", "--host", "--policy", "--health-interval", "--http-threads", "--backlog", "--upstream-timeout",
                         "--served-model-name"},
                        {}, serve::route_usage);
    serve::Proxy proxy(options, upstreams);
    return proxy.run();
}
