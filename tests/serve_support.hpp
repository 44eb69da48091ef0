// Helpers for the tests that drive `infer serve` and `infer route` as processes over real HTTP on loopback: a child
// process with its stderr kept, a server on a free port that is healthy when constructed, requests streamed or not,
// and /metrics read back (without the model_name label every series carries).
#pragma once

#include "support.hpp"

#include "server.hpp"
#include "serving_client.hpp"

#include <httplib.h>
#include <nlohmann/json.hpp>

#include <csignal>
#include <thread>
#include <unistd.h>

namespace serve_test {

using nlohmann::json;
using client::free_port;

// A child process (infer serve, infer route, nginx) with its stderr in a temporary file.
class Process {
public:
    Process(const std::vector<std::string>& args, const std::string& name) : dir_(name) {
        pid_ = client::spawn(args, (dir_ / "stderr").string());
    }
    Process(const Process&) = delete;
    ~Process() {
        if (pid_ > 0) {
            ::kill(pid_, SIGKILL);
            ::waitpid(pid_, nullptr, 0);
        }
    }
    // Sends `signal` and returns the exit code (128 + signal when killed by one).
    int stop(int signal = SIGTERM) {
        ::kill(pid_, signal);
        int status = 0;
        ::waitpid(pid_, &status, 0);
        pid_ = -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
    std::string log() const { return infer::read_text_file(dir_ / "stderr"); }
    const test::TempDir& dir() const { return dir_; }

private:
    test::TempDir dir_;
    pid_t pid_ = -1;
};

inline std::string infer_bin() {
    const char* bin = std::getenv("INFER_BIN");
    REQUIRE_MESSAGE(bin != nullptr, "INFER_BIN is not set (meson test sets it)");
    return bin;
}

// Polls GET /health until it answers `status` (a server loading, or an upstream dying); false after 60 s.
inline bool wait_for_health(int port, int status = 200) {
    for (int i = 0; i < 600; ++i) {
        httplib::Client client("127.0.0.1", port);
        client.set_connection_timeout(1);
        auto answer = client.Get("/health");
        if ((answer ? answer->status : 0) == status) return true;
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    return false;
}

// `infer serve` with the demo model (chat template chatml) on a free port, ready when constructed.
class Server {
public:
    explicit Server(std::vector<std::string> args = {}, int port = 0)
        : port_(port ? port : free_port()),
          process_(with(std::move(args), port_), "serve") {
        REQUIRE_MESSAGE(wait_for_health(port_), "infer serve did not become healthy:\n" << process_.log());
    }
    int port() const { return port_; }
    std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }
    int stop(int signal = SIGTERM) { return process_.stop(signal); }
    std::string log() const { return process_.log(); }

private:
    static std::vector<std::string> with(std::vector<std::string> args, int port) {
        std::vector<std::string> all = {infer_bin(), "serve", "--port", std::to_string(port), "--chat-template", "chatml", "-t", "1"};
        all.insert(all.end(), args.begin(), args.end());
        return all;
    }
    int port_;
    Process process_;
};

inline httplib::Result post(int port, const std::string& path, const std::string& body, const httplib::Headers& headers = {}) {
    httplib::Client client("127.0.0.1", port);
    client.set_read_timeout(120);
    return client.Post(path.c_str(), headers, body, "application/json");
}

// A streamed response read to its end: the data: payloads in order (the last should be "[DONE]").
struct Streamed {
    int status = 0;
    std::vector<std::string> events;
    std::string text;  // the choices' text or delta content, concatenated
    json usage, timing, last_choice_chunk;
    json tool_calls = json::array();  // chat: the streamed calls put together, as a client accumulates them by index
};

inline Streamed stream(int port, const std::string& path, const std::string& body,
                const std::function<bool(const std::string&)>& on_event = nullptr) {
    Streamed s;
    std::string buffer;
    httplib::Client client("127.0.0.1", port);
    client.set_read_timeout(120);
    httplib::Request request;
    request.method = "POST";
    request.path = path;
    request.body = body;
    request.headers = {{"Content-Type", "application/json"}};
    request.response_handler = [&](const httplib::Response& head) {
        s.status = head.status;
        return true;
    };
    request.content_receiver = [&](const char* data, size_t size, uint64_t, uint64_t) {
        buffer.append(data, size);
        for (size_t end; (end = buffer.find("\n\n")) != std::string::npos;) {
            std::string event = buffer.substr(0, end);
            buffer.erase(0, end + 2);
            REQUIRE(event.rfind("data: ", 0) == 0);
            s.events.push_back(event.substr(6));
            if (on_event && !on_event(s.events.back())) return false;
        }
        return true;
    };
    httplib::Response response;
    httplib::Error error;
    client.send(request, response, error);
    for (const std::string& event : s.events) {
        if (event == "[DONE]") continue;
        json chunk = json::parse(event);
        if (chunk.contains("usage") && !chunk["usage"].is_null()) s.usage = chunk["usage"];
        if (chunk.contains("infer_timing")) s.timing = chunk["infer_timing"];
        for (const json& choice : chunk["choices"]) {
            if (choice.contains("text")) s.text += choice["text"].get<std::string>();
            if (choice.contains("delta") && choice["delta"].contains("content") && choice["delta"]["content"].is_string())
                s.text += choice["delta"]["content"].get<std::string>();
            if (choice.contains("delta") && choice["delta"].contains("tool_calls"))
                for (const json& call : choice["delta"]["tool_calls"]) {
                    const size_t index = call["index"].get<size_t>();
                    while (s.tool_calls.size() <= index) s.tool_calls.push_back({{"function", {{"arguments", ""}}}});
                    json& whole = s.tool_calls[index];
                    if (call.contains("id")) {
                        whole["id"] = call["id"];
                        whole["type"] = call["type"];
                        whole["function"]["name"] = call["function"]["name"];
                    }
                    whole["function"]["arguments"] = whole["function"]["arguments"].get<std::string>() +
                                                     call["function"]["arguments"].get<std::string>();
                }
            s.last_choice_chunk = chunk;
        }
    }
    return s;
}

inline std::map<std::string, double> metrics(int port) {
    httplib::Client client("127.0.0.1", port);
    auto answer = client.Get("/metrics");
    REQUIRE(answer);
    REQUIRE(answer->status == 200);
    std::map<std::string, double> samples;  // looked up without the model_name label every series carries
    for (const auto& [series, value] : serve::parse_prometheus(answer->body)) samples[client::without_model_label(series)] = value;
    return samples;
}

inline double metric(const std::map<std::string, double>& samples, const std::string& name) {
    auto found = samples.find(name);
    return found == samples.end() ? 0 : found->second;
}

// Polls /metrics until `name` reaches `value` (false after 30 s).
inline bool wait_for_metric(int port, const std::string& name, double value) {
    for (int i = 0; i < 300; ++i) {
        if (metric(metrics(port), name) == value) return true;
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    return false;
}

}  // namespace serve_test
