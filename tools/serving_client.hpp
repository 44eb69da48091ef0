// serving_client.hpp — what chapters 08 and 09 need to drive `infer serve` from outside, as a user would: start the
// server as a process, wait for /health, send requests (streamed, to time the first token), read /metrics.
#pragma once

#include "infer.hpp"
#include "server.hpp"

#include <httplib.h>
#include <nlohmann/json.hpp>

#include <csignal>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>

namespace client {

inline int free_port() {
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0) infer::fail("no free port");
    socklen_t size = sizeof address;
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &size);
    ::close(fd);
    return ntohs(address.sin_port);
}

// Starts a program (args[0] is its path) as a child process with its stdout and stderr in `log_path`.
inline pid_t spawn(std::vector<std::string> args, const std::string& log_path) {
    std::vector<char*> argv;
    for (std::string& arg : args) argv.push_back(arg.data());
    argv.push_back(nullptr);
    pid_t pid = ::fork();
    if (pid < 0) infer::fail("fork failed");
    if (pid == 0) {
        int fd = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
        ::dup2(fd, 1);
        ::dup2(fd, 2);
        ::execv(argv[0], argv.data());
        ::_exit(127);
    }
    return pid;
}

// `infer serve ARGS --port P` as a child process (its log in `log_path`), stopped with SIGTERM when destroyed.
class ServeProcess {
public:
    ServeProcess(const std::string& infer, std::vector<std::string> args, const std::string& log_path = "/dev/null")
        : port_(free_port()) {
        args.insert(args.begin(), {infer, "serve", "--port", std::to_string(port_)});
        pid_ = spawn(std::move(args), log_path);
        for (int i = 0; i < 600; ++i) {
            httplib::Client probe("127.0.0.1", port_);
            auto health = probe.Get("/health");
            if (health && health->status == 200) return;
            int status = 0;
            if (::waitpid(pid_, &status, WNOHANG) == pid_) {
                pid_ = -1;
                infer::fail(infer, " serve exited before it was ready (see ", log_path, ")");
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(100));
        }
        infer::fail(infer, " serve did not become ready in 60 s");
    }
    ServeProcess(const ServeProcess&) = delete;
    ~ServeProcess() {
        if (pid_ > 0) {
            ::kill(pid_, SIGTERM);
            ::waitpid(pid_, nullptr, 0);
        }
    }
    int port() const { return port_; }

private:
    int port_;
    pid_t pid_ = -1;
};

// One streamed completion, timed from the client: time to the first content chunk, to the end, and the server's own
// breakdown (infer_timing) from the last chunk.
struct Timed {
    int status = 0;
    double ttft = -1, e2e = 0;
    int tokens = 0;
    nlohmann::json timing, usage;
};

inline Timed stream_completion(int port, const nlohmann::json& body) {
    Timed t;
    infer::Stopwatch clock;
    std::string buffer, error_body;
    httplib::Client http("127.0.0.1", port);
    http.set_read_timeout(600);
    httplib::Request request;
    request.method = "POST";
    request.path = "/v1/completions";
    nlohmann::json streamed = body;
    streamed["stream"] = true;
    streamed["stream_options"] = {{"include_usage", true}};
    request.body = streamed.dump();
    request.headers = {{"Content-Type", "application/json"}};
    request.response_handler = [&](const httplib::Response& head) {
        t.status = head.status;
        return true;
    };
    request.content_receiver = [&](const char* data, size_t size, uint64_t, uint64_t) {
        if (t.status != 200) return true;
        buffer.append(data, size);
        for (size_t end; (end = buffer.find("\n\n")) != std::string::npos;) {
            std::string event = buffer.substr(6, end - 6);  // after "data: "
            buffer.erase(0, end + 2);
            if (event == "[DONE]") continue;
            nlohmann::json chunk = nlohmann::json::parse(event);
            if (t.ttft < 0 && !chunk["choices"].empty()) t.ttft = clock.seconds();
            if (chunk.contains("usage") && !chunk["usage"].is_null()) t.usage = chunk["usage"];
            if (chunk.contains("infer_timing")) t.timing = chunk["infer_timing"];
        }
        return true;
    };
    httplib::Response response;
    httplib::Error error;
    http.send(request, response, error);
    t.e2e = clock.seconds();
    if (!t.usage.is_null()) t.tokens = t.usage["completion_tokens"].get<int>();
    return t;
}

inline std::map<std::string, double> scrape(int port) {
    httplib::Client http("127.0.0.1", port);
    auto answer = http.Get("/metrics");
    if (!answer || answer->status != 200) infer::fail("GET /metrics failed");
    return serve::parse_prometheus(answer->body);
}

// Sums every series of a metric family (all instances, all labels).
// A series' name without its model_name label (every series of infer serve carries one), so that lookups need not
// know the model: infer:x{model_name="m",instance="0"} → infer:x{instance="0"}; infer:x{model_name="m"} → infer:x.
inline std::string without_model_label(const std::string& series) {
    const size_t at = series.find("model_name=\"");
    if (at == std::string::npos) return series;
    size_t end = series.find('"', at + 12);
    while (end != std::string::npos && series[end - 1] == '\\') end = series.find('"', end + 1);
    if (end == std::string::npos) return series;
    std::string out = series.substr(0, at) + series.substr(end + 1 + (series[end + 1] == ',' ? 1 : 0));
    if (out.ends_with("{}")) out.resize(out.size() - 2);
    return out;
}

inline double total(const std::map<std::string, double>& samples, const std::string& name) {
    double sum = 0;
    for (const auto& [labelled, value] : samples) {
        const std::string series = without_model_label(labelled);
        if (series == name || series.rfind(name + "{", 0) == 0) sum += value;
    }
    return sum;
}

inline double percentile(std::vector<double> values, double p) {
    if (values.empty()) return 0;
    std::sort(values.begin(), values.end());
    return values[std::min(values.size() - 1, static_cast<size_t>(p / 100.0 * static_cast<double>(values.size())))];
}

// Runs `count` calls of `job(i)` on `concurrency` threads at once (a closed loop: each thread sends its next request
// when the last one is answered).
template <class Job>
void run_concurrently(int count, int concurrency, Job job) {
    std::atomic<int> next{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < concurrency; ++t)
        threads.emplace_back([&] {
            for (int i; (i = next++) < count;) job(i);
        });
    for (std::thread& thread : threads) thread.join();
}

}  // namespace client
