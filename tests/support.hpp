// Helpers shared by the tests: where the reference data lives, reading reference files, temporary folders, and
// running the infer program.
#pragma once

#include "infer.hpp"

#include <doctest/doctest.h>

#include <cstdlib>
#include <sys/wait.h>

namespace test {

// ../shared (the Meson option shared_dir), or empty when it is absent.
inline std::filesystem::path shared_dir() {
    const char* dir = std::getenv("INFER_SHARED");
    std::filesystem::path path = dir ? dir : "../shared";
    return std::filesystem::exists(path / "models" / "stories260K") ? path : std::filesystem::path();
}

// Tests that need ../shared call this first; without it they pass, and the run ends with one line naming every case
// skipped so and how to get the data (tests/doctest_main.cpp).
void note_skipped_for_want_of_data();
#define REQUIRE_SHARED_OR_SKIP()                 \
    if (test::shared_dir().empty()) {            \
        test::note_skipped_for_want_of_data();   \
        return;                                  \
    }

inline std::vector<float> read_floats(const std::filesystem::path& path) {
    std::string bytes = infer::read_text_file(path);
    std::vector<float> values(bytes.size() / 4);
    std::memcpy(values.data(), bytes.data(), values.size() * 4);
    return values;
}

inline std::vector<int> ids_of(const infer::Json& array) {
    std::vector<int> ids;
    for (const infer::Json& id : array.as_array()) ids.push_back(static_cast<int>(id.as_int()));
    return ids;
}

inline infer::Json read_json(const std::filesystem::path& path) {
    return infer::Json::parse(infer::read_text_file(path), path.string());
}

// llama.cpp's logits for stories260K at 64 positions: row i follows token_ids[i] (the prompt's rows come from one
// prefill, the rest from one-token decodes of the greedy continuation). [64, 512]
struct StoriesLogits {
    std::vector<int> ids;
    int prompt_length = 0;
    std::vector<float> logits;
};

inline StoriesLogits stories_logits() {
    const std::filesystem::path folder = shared_dir() / "models/stories260K/public";
    infer::Json meta = read_json(folder / "logits_lily_and_ben_64.json");
    return {ids_of(meta.at("token_ids")), static_cast<int>(meta.at("prompt_ids").as_array().size()),
            read_floats(folder / "logits_lily_and_ben_64.f32")};
}

// A fresh folder under the system's temporary directory, removed when the test ends.
class TempDir {
public:
    explicit TempDir(const std::string& name) {
        path_ = std::filesystem::temp_directory_path() /
                ("infer-test-" + name + "-" + std::to_string(::getpid()) + "-" + std::to_string(counter()++));
        std::filesystem::remove_all(path_);
        std::filesystem::create_directories(path_);
    }
    ~TempDir() { std::filesystem::remove_all(path_); }
    const std::filesystem::path& path() const { return path_; }
    std::filesystem::path operator/(const std::string& name) const { return path_ / name; }

private:
    static int& counter() {
        static int value = 0;
        return value;
    }
    std::filesystem::path path_;
};

inline void write_file(const std::filesystem::path& path, std::string_view bytes) {
    std::ofstream out(path, std::ios::binary);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// The message of the infer::Error that `body` throws ("" when it throws none).
template <class Body>
std::string error_of(Body&& body) {
    try {
        body();
    } catch (const infer::Error& e) {
        return e.what();
    }
    return "";
}

// Feeds ids to a TextStream one at a time; every piece it returns must be whole UTF-8. Returns their concatenation.
inline std::string stream_decode(const infer::Tokenizer& tokenizer, const std::vector<int>& ids) {
    infer::TextStream stream(tokenizer);
    std::string streamed;
    for (int id : ids) {
        std::string piece = stream.push(id);
        CHECK(infer::detail::find_invalid_utf8(piece) == std::string_view::npos);
        streamed += piece;
    }
    return streamed + stream.finish();
}

// Sampling parameters the engine suites share: greedy (exact ids), and seeded sampling with every truncation on, so a
// run repeats itself only if the sampler's generator is handled right.
inline infer::SamplingParams greedy(int max_tokens) {
    infer::SamplingParams params;
    params.temperature = 0;
    params.max_tokens = max_tokens;
    return params;
}

inline infer::SamplingParams seeded(int max_tokens, uint64_t seed) {
    infer::SamplingParams params;
    params.temperature = 0.9f;
    params.top_k = 40;
    params.top_p = 0.95f;
    params.seed = seed;
    params.max_tokens = max_tokens;
    return params;
}

// Logits of every position after feeding `ids` from position 0 in one prefill.
inline std::vector<float> prefill_logits(const infer::Model& model, const std::vector<int>& ids, int threads = 2,
                                         infer::DType cache_type = infer::DType::F32) {
    infer::ThreadPool pool(threads);
    infer::KVCache cache(model.config, static_cast<int>(ids.size() + 15) / 16, 16, cache_type);
    REQUIRE(cache.reserve(0, static_cast<int>(ids.size())));
    infer::Batch batch;
    for (size_t i = 0; i < ids.size(); ++i) batch.add(ids[i], static_cast<int>(i), 0, true);
    infer::ForwardPass forward(model, pool);
    std::span<const float> logits = forward.forward(batch, cache);
    return {logits.begin(), logits.end()};
}

struct ProgramRun {
    int exit_code = -1;
    std::string out, err;
};

inline std::string quote(const std::string& text) {
    std::string quoted = "'";
    for (char c : text) quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
    return quoted + "'";
}

// Runs a shell command with `input` on stdin; captures stdout, stderr and the exit code.
inline ProgramRun run_command(const std::string& command, const std::string& input = "") {
    TempDir dir("run");
    write_file(dir / "in", input);
    std::string redirected = "(" + command + ") > " + quote((dir / "out").string()) + " 2> " +
                             quote((dir / "err").string()) + " < " + quote((dir / "in").string());
    int status = std::system(redirected.c_str());
    ProgramRun run;
    run.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    run.out = infer::read_text_file(dir / "out");
    run.err = infer::read_text_file(dir / "err");
    return run;
}

// Runs the infer program (INFER_BIN) with arguments and `input` on stdin.
inline ProgramRun run_infer(const std::vector<std::string>& args, const std::string& input = "") {
    const char* bin = std::getenv("INFER_BIN");
    REQUIRE_MESSAGE(bin != nullptr, "INFER_BIN is not set (meson test sets it)");
    std::string command = quote(bin);
    for (const auto& arg : args) command += ' ' + quote(arg);
    return run_command(command, input);
}

// A JSON value against a JSON Schema of the subset the structured-output tests use (types, properties/required,
// enum, const, anyOf, string lengths, integer bounds, array sizes), written apart from the regex writer it checks.
inline bool valid_json(const infer::Json& v, const infer::Json& s) {
    if (const infer::Json* c = s.find("const")) return v.dump() == c->dump();
    if (const infer::Json* e = s.find("enum"))
        return std::any_of(e->as_array().begin(), e->as_array().end(), [&](const infer::Json& x) { return x.dump() == v.dump(); });
    if (const infer::Json* any = s.find("anyOf"))
        return std::any_of(any->as_array().begin(), any->as_array().end(), [&](const infer::Json& x) { return valid_json(v, x); });
    const std::string type = s.find("type") ? s.at("type").as_string() : "";
    auto number = [&](const char* key, double fallback) { return s.find(key) ? s.at(key).as_number() : fallback; };
    if (type == "object") {
        if (!v.is_object()) return false;
        if (const infer::Json* required = s.find("required"))
            for (const infer::Json& name : required->as_array())
                if (!v.find(name.as_string())) return false;
        for (const auto& [key, value] : v.as_object())
            if (!s.at("properties").find(key) || !valid_json(value, s.at("properties").at(key))) return false;
        return true;
    }
    if (type == "array") {
        if (!v.is_array()) return false;
        const double size = static_cast<double>(v.as_array().size());
        if (size < number("minItems", 0) || size > number("maxItems", 1e9)) return false;
        return std::all_of(v.as_array().begin(), v.as_array().end(), [&](const infer::Json& item) { return !s.find("items") || valid_json(item, s.at("items")); });
    }
    if (type == "string") {
        if (!v.is_string()) return false;
        double characters = 0;  // code points, as JSON Schema counts length
        for (unsigned char c : v.as_string()) characters += (c & 0xC0) != 0x80;
        return characters >= number("minLength", 0) && characters <= number("maxLength", 1e9);
    }
    if (type == "integer")
        return v.is_number() && v.as_number() == std::floor(v.as_number()) && v.as_number() >= number("minimum", -1e18) &&
               v.as_number() <= number("maximum", 1e18);
    if (type == "number") return v.is_number();
    if (type == "boolean") return v.is_bool();
    if (type == "null") return v.is_null();
    return true;
}

}  // namespace test
