// infer.hpp — the LLM inference stack, layer by layer, in one readable header.
//
// A checkpoint on disk becomes text through a chain of layers. This header holds the engine's layers in the order a
// request's data flows through them, each under a banner that says what it does and what it costs:
//
//   1. Prelude            errors, memory-mapped files, a JSON reader, bf16/f16, timers, a thread pool
//   2. Weights on disk    safetensors (+ config.json), GGUF v3, llama2.c .bin → one Model   (chapter 02)
//   3. Tokenizer          SentencePiece score-based BPE (llama2.c, GGUF "llama" vocabularies) (chapter 03)
//   4. KV cache           a pool of fixed-size blocks and a block table per sequence         (chapter 05)
//   5. Forward pass       one function for prefill and decode over a batch of tokens         (chapter 04)
//   6. Sampler            temperature, top-k, top-p, min-p, penalties, seeded                (chapter 04)
//   7. Generation         one request end to end, timed layer by layer                       (chapter 01)
//   8. Model factory      random-weight models: the built-in demo and `infer make-model`     (chapter 02)
//
// Quick start (compile with -std=c++20 -O2 -march=native -pthread):
//
//   #include "infer.hpp"
//   #include <iostream>
//   int main() {
//       infer::Model model = infer::load_model("stories260K.gguf");
//       infer::ThreadPool pool;                       // all cores
//       infer::SamplingParams params;                 // defaults; temperature 0 is greedy
//       params.temperature = 0;
//       params.max_tokens = 64;
//       infer::generate(model, pool, "Once upon a time", params,
//                       [](std::string_view text) { std::cout << text << std::flush; });
//   }
//
// Dimension letters in shape comments:
//   T tokens in the batch   D model width        H / Hkv query / key-value heads   Dh head size
//   F feed-forward width    L layers             V vocabulary                      B block size (tokens per KV block)
//   N output rows of a matrix, K its input width (a weight is stored [N, K], row-major, as PyTorch's nn.Linear)
//
// Configuration: nothing to define. With AVX2+FMA (e.g. -march=native on x86-64) the matrix-vector kernels use
// intrinsics; elsewhere a plain loop that compilers vectorize computes the same sums in the same order.
//
// Limitations (this version): CPU only here (CUDA kernels live in infer_cuda.cu); weights in F32, F16 or BF16 (quantized
// GGUF types are refused by name); the tokenizer section reads SentencePiece score vocabularies only (Hugging Face
// tokenizer.json arrives with the tokenizer layer), so a Hugging Face folder runs from token ids.
//
// Errors: every failure a user can cause throws infer::Error whose message names the file, field or value.
//
// Version 0.1.0. Standard library only; all functions inline; internals in infer::detail.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <random>
#include <span>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <utility>
#include <variant>
#include <vector>

#if defined(__unix__) || defined(__APPLE__)
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#define INFER_HAVE_MMAP 1
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define INFER_HAVE_AVX2 1
#endif

namespace infer {

// =====================================================================================================================
// 1. PRELUDE — the tools every layer uses: one error type, files mapped into memory, a JSON reader, 16-bit floats,
//    stopwatches and a thread pool. Nothing here is specific to language models; all of it is cheap next to the
//    forward pass, except the thread pool's wake-up, which decode pays a few dozen times per token.
// =====================================================================================================================

// The one exception type. Its message is the whole diagnosis: which file, field or value, and what was expected.
struct Error : std::runtime_error {
    using std::runtime_error::runtime_error;
};

namespace detail {

template <class... Parts>
std::string concat(const Parts&... parts) {
    std::ostringstream out;
    (out << ... << parts);
    return out.str();
}

template <class... Parts>
[[noreturn]] void fail(const Parts&... parts) {
    throw Error(concat(parts...));
}

inline bool ends_with(std::string_view text, std::string_view suffix) {
    return text.size() >= suffix.size() && text.substr(text.size() - suffix.size()) == suffix;
}

}  // namespace detail

// A read-only view of a whole file. Where the OS allows, the file is mapped, not read: loading a multi-gigabyte
// checkpoint then costs page-table setup, and each weight is paged in from the page cache the first time a matmul
// touches it. Elsewhere the bytes are read into memory.
class MappedFile {
public:
    MappedFile() = default;
    explicit MappedFile(const std::filesystem::path& path) : path_(path.string()) {
#ifdef INFER_HAVE_MMAP
        int fd = ::open(path_.c_str(), O_RDONLY);
        if (fd < 0) detail::fail(path_, ": cannot open: ", std::strerror(errno));
        struct stat info {};
        if (::fstat(fd, &info) != 0 || !S_ISREG(info.st_mode)) {
            ::close(fd);
            detail::fail(path_, ": not a regular file");
        }
        size_ = static_cast<size_t>(info.st_size);
        if (size_ > 0) {
            void* mapped = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
            if (mapped == MAP_FAILED) {
                ::close(fd);
                detail::fail(path_, ": mmap failed: ", std::strerror(errno));
            }
            data_ = static_cast<const std::byte*>(mapped);
        }
        ::close(fd);  // the mapping keeps the file alive
#else
        std::ifstream in(path, std::ios::binary);
        if (!in) detail::fail(path_, ": cannot open");
        in.seekg(0, std::ios::end);
        size_ = static_cast<size_t>(in.tellg());
        in.seekg(0);
        copy_.resize(size_);
        in.read(reinterpret_cast<char*>(copy_.data()), static_cast<std::streamsize>(size_));
        data_ = copy_.data();
#endif
    }
    MappedFile(const MappedFile&) = delete;
    MappedFile& operator=(const MappedFile&) = delete;
    ~MappedFile() {
#ifdef INFER_HAVE_MMAP
        if (data_ && size_ > 0) ::munmap(const_cast<std::byte*>(data_), size_);
#endif
    }

    const std::byte* data() const { return data_; }
    size_t size() const { return size_; }
    const std::string& path() const { return path_; }

private:
    std::string path_;
    const std::byte* data_ = nullptr;
    size_t size_ = 0;
#ifndef INFER_HAVE_MMAP
    std::vector<std::byte> copy_;
#endif
};

inline std::string read_text_file(const std::filesystem::path& path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) detail::fail(path.string(), ": cannot open");
    std::ostringstream text;
    text << in.rdbuf();
    return text.str();
}

// ---- JSON -----------------------------------------------------------------------------------------------------------
// Just enough JSON for config.json, safetensors headers and test references: a value tree, a strict parser whose
// errors give the byte offset, and lookups whose errors name the missing field.

class Json {
public:
    using Array = std::vector<Json>;
    using Object = std::vector<std::pair<std::string, Json>>;  // keeps the file's order

    Json() = default;  // null
    explicit Json(bool value) : value_(value) {}
    explicit Json(double value) : value_(value) {}
    explicit Json(std::string value) : value_(std::move(value)) {}
    explicit Json(Array value) : value_(std::move(value)) {}
    explicit Json(Object value) : value_(std::move(value)) {}

    bool is_null() const { return std::holds_alternative<std::monostate>(value_); }
    bool is_bool() const { return std::holds_alternative<bool>(value_); }
    bool is_number() const { return std::holds_alternative<double>(value_); }
    bool is_string() const { return std::holds_alternative<std::string>(value_); }
    bool is_array() const { return std::holds_alternative<Array>(value_); }
    bool is_object() const { return std::holds_alternative<Object>(value_); }

    bool as_bool() const { return get<bool>("a boolean"); }
    double as_number() const { return get<double>("a number"); }
    const std::string& as_string() const { return get<std::string>("a string"); }
    const Array& as_array() const { return get<Array>("an array"); }
    const Object& as_object() const { return get<Object>("an object"); }
    int64_t as_int() const {
        double number = as_number();
        if (number != std::floor(number) || std::abs(number) > 9007199254740992.0)
            detail::fail("expected an integer, found ", number);
        return static_cast<int64_t>(number);
    }

    // Object member or nullptr.
    const Json* find(std::string_view key) const {
        if (!is_object()) return nullptr;
        for (const auto& [name, value] : std::get<Object>(value_))
            if (name == key) return &value;
        return nullptr;
    }
    const Json& at(std::string_view key) const {
        const Json* member = find(key);
        if (!member) detail::fail("missing field \"", key, "\"");
        return *member;
    }

    static Json parse(std::string_view text, std::string_view origin = "JSON");

private:
    template <class T>
    const T& get(const char* expected) const {
        if (const T* value = std::get_if<T>(&value_)) return *value;
        detail::fail("expected ", expected, ", found ", kind_name());
    }
    const char* kind_name() const {
        static constexpr const char* names[] = {"null", "a boolean", "a number", "a string", "an array", "an object"};
        return names[value_.index()];
    }
    std::variant<std::monostate, bool, double, std::string, Array, Object> value_;
};

namespace detail {

inline void append_utf8(std::string& out, uint32_t code_point) {
    if (code_point < 0x80) {
        out += static_cast<char>(code_point);
    } else if (code_point < 0x800) {
        out += static_cast<char>(0xC0 | (code_point >> 6));
        out += static_cast<char>(0x80 | (code_point & 0x3F));
    } else if (code_point < 0x10000) {
        out += static_cast<char>(0xE0 | (code_point >> 12));
        out += static_cast<char>(0x80 | ((code_point >> 6) & 0x3F));
        out += static_cast<char>(0x80 | (code_point & 0x3F));
    } else {
        out += static_cast<char>(0xF0 | (code_point >> 18));
        out += static_cast<char>(0x80 | ((code_point >> 12) & 0x3F));
        out += static_cast<char>(0x80 | ((code_point >> 6) & 0x3F));
        out += static_cast<char>(0x80 | (code_point & 0x3F));
    }
}

class JsonParser {
public:
    JsonParser(std::string_view text, std::string_view origin) : text_(text), origin_(origin) {}

    Json parse_document() {
        Json value = parse_value(0);
        skip_space();
        if (pos_ != text_.size()) error("unexpected text after the JSON value");
        return value;
    }

private:
    static constexpr int max_depth = 256;  // a hostile file cannot blow the stack

    [[noreturn]] void error(std::string_view what) const { fail(origin_, ": invalid JSON at byte ", pos_, ": ", what); }

    void skip_space() {
        while (pos_ < text_.size() && (text_[pos_] == ' ' || text_[pos_] == '\n' || text_[pos_] == '\r' || text_[pos_] == '\t'))
            ++pos_;
    }
    bool consume(char expected) {
        skip_space();
        if (pos_ < text_.size() && text_[pos_] == expected) {
            ++pos_;
            return true;
        }
        return false;
    }
    void expect(char expected) {
        if (!consume(expected)) error(concat("expected '", expected, "'"));
    }
    bool consume_word(std::string_view word) {
        if (text_.substr(pos_, word.size()) != word) return false;
        pos_ += word.size();
        return true;
    }

    Json parse_value(int depth) {
        if (depth > max_depth) error("nesting too deep");
        skip_space();
        if (pos_ >= text_.size()) error("unexpected end of input");
        char c = text_[pos_];
        if (c == '{') return parse_object(depth);
        if (c == '[') return parse_array(depth);
        if (c == '"') return Json(parse_string());
        if (consume_word("true")) return Json(true);
        if (consume_word("false")) return Json(false);
        if (consume_word("null")) return Json();
        if (c == '-' || (c >= '0' && c <= '9')) return parse_number();
        // NaN and Infinity are not JSON, but Python's json module writes them: accept them as numbers.
        if (consume_word("NaN")) return Json(std::numeric_limits<double>::quiet_NaN());
        if (consume_word("Infinity")) return Json(std::numeric_limits<double>::infinity());
        error(concat("unexpected character '", c, "'"));
    }

    Json parse_object(int depth) {
        ++pos_;
        Json::Object members;
        if (consume('}')) return Json(std::move(members));
        do {
            skip_space();
            if (pos_ >= text_.size() || text_[pos_] != '"') error("expected a string key");
            std::string key = parse_string();
            expect(':');
            members.emplace_back(std::move(key), parse_value(depth + 1));
        } while (consume(','));
        expect('}');
        return Json(std::move(members));
    }

    Json parse_array(int depth) {
        ++pos_;
        Json::Array items;
        if (consume(']')) return Json(std::move(items));
        do items.push_back(parse_value(depth + 1));
        while (consume(','));
        expect(']');
        return Json(std::move(items));
    }

    Json parse_number() {
        size_t start = pos_;
        if (text_[pos_] == '-') {
            ++pos_;
            if (consume_word("Infinity")) return Json(-std::numeric_limits<double>::infinity());
        }
        while (pos_ < text_.size() && std::strchr("0123456789.eE+-", text_[pos_])) ++pos_;
        std::string digits(text_.substr(start, pos_ - start));
        char* end = nullptr;
        double value = std::strtod(digits.c_str(), &end);
        if (end != digits.c_str() + digits.size() || digits == "-") {
            pos_ = start;
            error(concat("malformed number \"", digits, "\""));
        }
        return Json(value);
    }

    uint32_t parse_hex4() {
        if (pos_ + 4 > text_.size()) error("truncated \\u escape");
        uint32_t value = 0;
        for (int i = 0; i < 4; ++i) {
            char c = text_[pos_++];
            value <<= 4;
            if (c >= '0' && c <= '9') value |= c - '0';
            else if (c >= 'a' && c <= 'f') value |= c - 'a' + 10;
            else if (c >= 'A' && c <= 'F') value |= c - 'A' + 10;
            else error("bad hex digit in \\u escape");
        }
        return value;
    }

    std::string parse_string() {
        ++pos_;  // opening quote
        std::string out;
        while (true) {
            if (pos_ >= text_.size()) error("unterminated string");
            char c = text_[pos_++];
            if (c == '"') return out;
            if (static_cast<unsigned char>(c) < 0x20) error("control character in string");
            if (c != '\\') {
                out += c;
                continue;
            }
            if (pos_ >= text_.size()) error("unterminated escape");
            char escaped = text_[pos_++];
            switch (escaped) {
                case '"': out += '"'; break;
                case '\\': out += '\\'; break;
                case '/': out += '/'; break;
                case 'b': out += '\b'; break;
                case 'f': out += '\f'; break;
                case 'n': out += '\n'; break;
                case 'r': out += '\r'; break;
                case 't': out += '\t'; break;
                case 'u': {
                    uint32_t code = parse_hex4();
                    // A UTF-16 surrogate pair encodes one code point above U+FFFF.
                    if (code >= 0xD800 && code < 0xDC00 && text_.substr(pos_, 2) == "\\u") {
                        pos_ += 2;
                        uint32_t low = parse_hex4();
                        if (low < 0xDC00 || low > 0xDFFF) error("unpaired surrogate in \\u escape");
                        code = 0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00);
                    }
                    append_utf8(out, code);
                    break;
                }
                default: error(concat("unknown escape \\", escaped));
            }
        }
    }

    std::string_view text_;
    std::string origin_;
    size_t pos_ = 0;
};

inline void write_json_string(std::ostream& out, std::string_view text) {
    out << '"';
    for (char c : text) {
        if (c == '"' || c == '\\') out << '\\' << c;
        else if (c == '\n') out << "\\n";
        else if (static_cast<unsigned char>(c) < 0x20) {
            char escape[8];
            std::snprintf(escape, sizeof escape, "\\u%04x", static_cast<unsigned>(c));
            out << escape;
        } else out << c;
    }
    out << '"';
}

}  // namespace detail

inline Json Json::parse(std::string_view text, std::string_view origin) {
    return detail::JsonParser(text, origin).parse_document();
}

// ---- 16-bit floats ---------------------------------------------------------------------------------------------------
// bf16 is the top half of an f32 (same exponent range, 8 mantissa bits): widening is a shift. f16 has 5 exponent bits,
// so widening rebuilds the exponent. Checkpoints store weights this way to halve the bytes a decode step must read.

inline float bf16_to_f32(uint16_t bits) { return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16); }

inline uint16_t f32_to_bf16(float value) {
    uint32_t bits = std::bit_cast<uint32_t>(value);
    if ((bits & 0x7FFFFFFF) > 0x7F800000) return static_cast<uint16_t>((bits >> 16) | 0x40);  // keep NaN a NaN
    bits += 0x7FFF + ((bits >> 16) & 1);                                                       // round to nearest even
    return static_cast<uint16_t>(bits >> 16);
}

inline float f16_to_f32(uint16_t half) {
    uint32_t sign = static_cast<uint32_t>(half & 0x8000) << 16;
    uint32_t exponent = (half >> 10) & 0x1F;
    uint32_t mantissa = half & 0x3FF;
    if (exponent == 0x1F) return std::bit_cast<float>(sign | 0x7F800000 | (mantissa << 13));  // inf / NaN
    if (exponent == 0) {
        if (mantissa == 0) return std::bit_cast<float>(sign);
        float subnormal = std::ldexp(static_cast<float>(mantissa), -24);
        return sign ? -subnormal : subnormal;
    }
    return std::bit_cast<float>(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

inline uint16_t f32_to_f16(float value) {
    uint32_t bits = std::bit_cast<uint32_t>(value);
    uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000);
    float magnitude = std::fabs(value);
    if (std::isnan(value)) return sign | 0x7E00;
    if (magnitude >= 65520.0f) return sign | 0x7C00;  // rounds to infinity
    if (magnitude < 6.103515625e-05f) {                 // subnormal: a multiple of 2^-24
        return sign | static_cast<uint16_t>(std::nearbyint(magnitude * 16777216.0f));
    }
    int exponent = 0;
    float fraction = std::frexp(magnitude, &exponent);  // magnitude = fraction * 2^exponent, fraction in [0.5, 1)
    uint32_t mantissa = static_cast<uint32_t>(std::nearbyint((fraction * 2.0f - 1.0f) * 1024.0f));
    if (mantissa == 1024) {
        mantissa = 0;
        ++exponent;
    }
    return sign | static_cast<uint16_t>(((exponent + 14) << 10) | mantissa);
}

// ---- Timers ----------------------------------------------------------------------------------------------------------

class Stopwatch {
public:
    Stopwatch() : start_(std::chrono::steady_clock::now()) {}
    double seconds() const { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count(); }
    void restart() { start_ = std::chrono::steady_clock::now(); }

private:
    std::chrono::steady_clock::time_point start_;
};

// Where one request's time went, layer by layer (chapter 01 prints this table).
struct LayerTimes {
    double load = 0, tokenize = 0, prefill = 0, decode = 0, sample = 0, detokenize = 0;
};

// ---- Thread pool -----------------------------------------------------------------------------------------------------
// A matmul's rows are split into one contiguous range per thread; the caller runs the first range itself. Decode runs
// a few parallel sections per layer, each a fraction of a millisecond, so the hand-off must cost microseconds: between
// sections a worker spins on an atomic counter for a short while (spin_budget) before it sleeps on it (a futex on
// Linux, tens of microseconds to wake on a VM). An idle pool therefore costs nothing after the budget runs out.

namespace detail {
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
}

// Calls ready() until it returns true or the budget runs out; returns its last answer. After a few microseconds of
// pure spinning it yields the core at each round, so that when the machine has more runnable threads than cores (tests
// in parallel, other programs) the thread we wait for gets to run instead of our spin.
template <class Ready>
bool spin_until(Ready ready, std::chrono::microseconds budget) {
    auto deadline = std::chrono::steady_clock::now() + budget;
    for (int round = 0;; ++round) {
        if (ready()) return true;
        if (round < 256) {
            cpu_relax();
            continue;
        }
        std::this_thread::yield();
        if (std::chrono::steady_clock::now() > deadline) return ready();
    }
}
}  // namespace detail

class ThreadPool {
public:
    // 0 threads: one per hardware thread.
    explicit ThreadPool(int threads = 0) {
        if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
        size_ = threads;
        for (int i = 1; i < threads; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
    }
    ThreadPool(const ThreadPool&) = delete;
    ThreadPool& operator=(const ThreadPool&) = delete;
    ~ThreadPool() {
        stopping_ = true;
        generation_.fetch_add(1);
        generation_.notify_all();
        for (auto& worker : workers_) worker.join();
    }

    int size() const { return size_; }

    // Calls body(begin, end, thread) on `size()` disjoint ranges that cover [0, count) and returns when all are done.
    // One caller at a time: the engine's loop owns its pool.
    template <class Body>
    void run(size_t count, Body&& body) {
        if (size_ == 1 || count <= 1) {
            body(size_t{0}, count, 0);
            return;
        }
        job_ = [](void* context, size_t begin, size_t end, int thread) {
            (*static_cast<std::remove_reference_t<Body>*>(context))(begin, end, thread);
        };
        context_ = &body;
        count_ = count;
        pending_.store(size_ - 1);
        generation_.fetch_add(1);
        generation_.notify_all();
        run_share(0);
        while (!detail::spin_until([&] { return pending_.load() == 0; }, spin_budget)) {
            int left = pending_.load();
            if (left != 0) pending_.wait(left);
        }
    }

private:
    static constexpr std::chrono::microseconds spin_budget{200};

    void run_share(int thread) {
        size_t begin = count_ * thread / size_;
        size_t end = count_ * (thread + 1) / size_;
        if (begin < end) job_(context_, begin, end, thread);
    }

    void worker_loop(int thread) {
        uint64_t seen = 0;
        while (true) {
            if (!detail::spin_until([&] { return generation_.load() != seen; }, spin_budget)) {
                generation_.wait(seen);
                continue;
            }
            seen = generation_.load();
            if (stopping_) return;
            run_share(thread);
            if (pending_.fetch_sub(1) == 1) pending_.notify_one();
        }
    }

    int size_ = 1;
    std::vector<std::thread> workers_;
    // Each counter on its own cache line: workers poll one while the caller polls the other.
    alignas(64) std::atomic<uint64_t> generation_{0};
    alignas(64) std::atomic<int> pending_{0};
    std::atomic<bool> stopping_{false};
    void (*job_)(void*, size_t, size_t, int) = nullptr;
    void* context_ = nullptr;
    size_t count_ = 0;
};

// =====================================================================================================================
// 2. WEIGHTS ON DISK — three formats become one Model. A Hugging Face folder (config.json + safetensors), a GGUF file
//    and a llama2.c .bin all hold the same matrices under different names and layouts. Tensors stay in their stored
//    dtype inside the mapped file (no copy): loading costs a header parse, and resident memory is what decode touches.
//    Chapter 02 checks the footprint arithmetic (parameters × bytes per parameter) against the file sizes.
// =====================================================================================================================

enum class DType { F32, F16, BF16 };

inline size_t dtype_size(DType dtype) { return dtype == DType::F32 ? 4 : 2; }
inline const char* dtype_name(DType dtype) {
    switch (dtype) {
        case DType::F32: return "F32";
        case DType::F16: return "F16";
        case DType::BF16: return "BF16";
    }
    return "?";
}

// A view of a weight matrix or vector inside a mapped file (or a buffer the Model owns). Shapes are row-major,
// outermost first, as PyTorch writes them: a linear layer's weight is [N, K].
struct Tensor {
    std::string name;
    DType dtype = DType::F32;
    std::vector<int64_t> shape;
    const std::byte* data = nullptr;

    bool empty() const { return data == nullptr; }
    int64_t elements() const {
        return std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<int64_t>());
    }
    size_t bytes() const { return static_cast<size_t>(elements()) * dtype_size(dtype); }
    int64_t rows() const { return shape.empty() ? 0 : shape.front(); }
    int64_t cols() const { return shape.empty() ? 0 : shape.back(); }
    // Element i of a 1-D tensor (norm gains, biases), widened to f32.
    float at(int64_t i) const {
        uint16_t half;
        switch (dtype) {
            case DType::F32: {
                float value;
                std::memcpy(&value, data + i * 4, 4);
                return value;
            }
            case DType::BF16: std::memcpy(&half, data + i * 2, 2); return bf16_to_f32(half);
            case DType::F16: std::memcpy(&half, data + i * 2, 2); return f16_to_f32(half);
        }
        return 0;
    }
    // Row r of a 2-D tensor widened into `out` (embedding lookup).
    void read_row(int64_t r, float* out) const {
        int64_t width = cols();
        for (int64_t i = 0; i < width; ++i) out[i] = at(r * width + i);
    }
};

inline std::string shape_string(const std::vector<int64_t>& shape) {
    std::string text = "[";
    for (size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
    return text + "]";
}

// How RoPE pairs the dimensions of a head. Hugging Face checkpoints rotate dimension i with i + Dh/2 ("rotate half",
// GPT-NeoX style). Meta's original checkpoints, llama2.c and GGUF "llama" files rotate adjacent pairs (2i, 2i+1): the
// converter permutes the q/k rows. Both give the same attention scores, so we follow the file instead of permuting.
enum class RopeStyle { HalfRotation, AdjacentPairs };

struct RopeScaling {
    enum class Kind { None, Linear, Llama3 } kind = Kind::None;
    double factor = 1, low_freq_factor = 1, high_freq_factor = 4, original_context = 8192;
};

struct ModelConfig {
    std::string architecture;  // llama, mistral, qwen2, qwen3
    int dim = 0;               // D
    int n_layers = 0;          // L
    int n_heads = 0;           // H
    int n_kv_heads = 0;        // Hkv (GQA: H is a multiple of Hkv; MQA: Hkv = 1)
    int head_dim = 0;          // Dh (qwen3: H × Dh may differ from D)
    int ffn_dim = 0;           // F
    int vocab_size = 0;        // V
    int context_length = 0;    // the largest position the model was built for
    double rope_theta = 10000;
    double norm_eps = 1e-5;
    int sliding_window = 0;  // 0: attend to the whole prefix
    RopeStyle rope_style = RopeStyle::HalfRotation;
    RopeScaling rope_scaling;
    bool qkv_bias = false;  // qwen2
    bool qk_norm = false;   // qwen3: RMSNorm over each head of q and k before RoPE
    bool tied_embeddings = false;
    int bos_id = -1;
    std::vector<int> eos_ids;
};

struct LayerWeights {
    Tensor attn_norm;         // [D]
    Tensor wq, wk, wv, wo;    // [H·Dh, D], [Hkv·Dh, D], [Hkv·Dh, D], [D, H·Dh]
    Tensor bq, bk, bv;        // [H·Dh], [Hkv·Dh], [Hkv·Dh] (qwen2), else empty
    Tensor q_norm, k_norm;    // [Dh] (qwen3), else empty
    Tensor ffn_norm;          // [D]
    Tensor w_gate, w_up;      // [F, D]
    Tensor w_down;            // [D, F]
};

// The SentencePiece vocabulary as llama2.c and GGUF "llama" files carry it: pieces with merge scores.
struct Vocabulary {
    enum class Type : int32_t { Normal = 1, Unknown = 2, Control = 3, UserDefined = 4, Unused = 5, Byte = 6 };
    std::vector<std::string> pieces;  // "▁the", "<0x0A>", "<s>" …
    std::vector<float> scores;        // higher merges first
    std::vector<Type> types;
    int unk_id = 0;
    bool add_bos = true;
    bool add_space_prefix = true;  // SentencePiece's add_dummy_prefix: " " + text
    bool empty() const { return pieces.empty(); }
};

struct Model {
    ModelConfig config;
    Tensor embedding;   // [V, D]
    Tensor final_norm;  // [D]
    Tensor lm_head;     // [V, D]; the embedding itself when tied
    std::vector<LayerWeights> layers;
    std::vector<float> rope_freq_divisors;  // [Dh/2] GGUF rope_freqs (llama3 scaling precomputed), else empty
    Vocabulary vocab;                       // empty for a Hugging Face folder (tokenizer.json: the tokenizer layer)
    std::string source;                     // the path it came from, for messages
    std::string format;                     // "safetensors", "gguf", "llama2.c", "built-in"

    std::vector<std::shared_ptr<MappedFile>> files;  // keep the mappings alive
    std::vector<std::vector<std::byte>> owned;       // or own the bytes (built-in models)

    // Tensors point into `files` or `owned`: a copy would point into the original's buffers, so a Model only moves.
    Model() = default;
    Model(Model&&) = default;
    Model& operator=(Model&&) = default;
    Model(const Model&) = delete;
    Model& operator=(const Model&) = delete;

    // Bytes of weights one decode step reads: every matrix once (the embedding only one row, unless it is the head).
    size_t weight_bytes_per_token() const {
        size_t total = final_norm.bytes() + lm_head.bytes() + static_cast<size_t>(embedding.cols()) * dtype_size(embedding.dtype);
        for (const auto& layer : layers)
            for (const Tensor* t : {&layer.attn_norm, &layer.wq, &layer.wk, &layer.wv, &layer.wo, &layer.bq, &layer.bk,
                                    &layer.bv, &layer.q_norm, &layer.k_norm, &layer.ffn_norm, &layer.w_gate, &layer.w_up,
                                    &layer.w_down})
                if (!t->empty()) total += t->bytes();
        return total;
    }
    int64_t parameter_count() const {
        int64_t total = embedding.elements() + final_norm.elements() + (config.tied_embeddings ? 0 : lm_head.elements());
        for (const auto& layer : layers)
            for (const Tensor* t : {&layer.attn_norm, &layer.wq, &layer.wk, &layer.wv, &layer.wo, &layer.bq, &layer.bk,
                                    &layer.bv, &layer.q_norm, &layer.k_norm, &layer.ffn_norm, &layer.w_gate, &layer.w_up,
                                    &layer.w_down})
                if (!t->empty()) total += t->elements();
        return total;
    }
};

namespace detail {

// Every tensor a Model needs, checked for presence and shape, so the forward pass can trust them.
inline void check_shape(const Tensor& tensor, const std::vector<int64_t>& expected, const std::string& source) {
    if (tensor.shape != expected)
        fail(source, ": tensor ", tensor.name, " has shape ", shape_string(tensor.shape), ", expected ",
             shape_string(expected));
}

inline void validate_config(const ModelConfig& c, const std::string& source) {
    auto positive = [&](int value, const char* field) {
        if (value <= 0) fail(source, ": ", field, " must be positive, found ", value);
    };
    positive(c.dim, "hidden size");
    positive(c.n_layers, "number of layers");
    positive(c.n_heads, "number of attention heads");
    positive(c.n_kv_heads, "number of key-value heads");
    positive(c.head_dim, "head dimension");
    positive(c.ffn_dim, "intermediate (ffn) size");
    positive(c.vocab_size, "vocabulary size");
    positive(c.context_length, "context length");
    if (c.n_heads % c.n_kv_heads != 0)
        fail(source, ": ", c.n_heads, " attention heads are not a multiple of ", c.n_kv_heads, " key-value heads");
    if (c.head_dim % 2 != 0) fail(source, ": head dimension ", c.head_dim, " is odd; RoPE needs pairs");
    if (!(c.norm_eps > 0)) fail(source, ": rms_norm_eps must be positive, found ", c.norm_eps);
    if (!(c.rope_theta > 0)) fail(source, ": rope_theta must be positive, found ", c.rope_theta);
}

inline void validate_model(const Model& m) {
    const ModelConfig& c = m.config;
    validate_config(c, m.source);
    const int64_t D = c.dim, F = c.ffn_dim, V = c.vocab_size, Dh = c.head_dim;
    const int64_t q_width = int64_t{c.n_heads} * Dh, kv_width = int64_t{c.n_kv_heads} * Dh;
    check_shape(m.embedding, {V, D}, m.source);
    check_shape(m.lm_head, {V, D}, m.source);
    check_shape(m.final_norm, {D}, m.source);
    if (static_cast<int>(m.layers.size()) != c.n_layers) fail(m.source, ": expected ", c.n_layers, " layers");
    for (const auto& layer : m.layers) {
        check_shape(layer.attn_norm, {D}, m.source);
        check_shape(layer.wq, {q_width, D}, m.source);
        check_shape(layer.wk, {kv_width, D}, m.source);
        check_shape(layer.wv, {kv_width, D}, m.source);
        check_shape(layer.wo, {D, q_width}, m.source);
        if (c.qkv_bias) {
            check_shape(layer.bq, {q_width}, m.source);
            check_shape(layer.bk, {kv_width}, m.source);
            check_shape(layer.bv, {kv_width}, m.source);
        }
        if (c.qk_norm) {
            check_shape(layer.q_norm, {Dh}, m.source);
            check_shape(layer.k_norm, {Dh}, m.source);
        }
        check_shape(layer.ffn_norm, {D}, m.source);
        check_shape(layer.w_gate, {F, D}, m.source);
        check_shape(layer.w_up, {F, D}, m.source);
        check_shape(layer.w_down, {D, F}, m.source);
    }
    if (!m.rope_freq_divisors.empty() && static_cast<int64_t>(m.rope_freq_divisors.size()) != Dh / 2)
        fail(m.source, ": rope_freqs has ", m.rope_freq_divisors.size(), " entries, expected ", Dh / 2);
    if (!m.vocab.empty() && static_cast<int>(m.vocab.pieces.size()) != c.vocab_size)
        fail(m.source, ": the vocabulary has ", m.vocab.pieces.size(), " tokens but the model's embedding has ",
             c.vocab_size, " rows");
}

// Reads fields of config.json with messages that name the file and the field.
class ConfigReader {
    template <class Get>
    auto checked(std::string_view key, Get get) const -> decltype(get()) {
        try {
            return get();
        } catch (const Error& e) {
            fail(file_, ": field \"", key, "\": ", e.what());
        }
    }

public:
    ConfigReader(const Json& json, std::string file) : json_(json), file_(std::move(file)) {}

    const Json* find(std::string_view key) const {
        const Json* value = json_.find(key);
        return value && !value->is_null() ? value : nullptr;
    }
    int64_t integer(std::string_view key) const {
        const Json* value = find(key);
        if (!value) fail(file_, ": missing field \"", key, "\"");
        return checked(key, [&] { return value->as_int(); });
    }
    int64_t integer_or(std::string_view key, int64_t fallback) const { return find(key) ? integer(key) : fallback; }
    double number_or(std::string_view key, double fallback) const {
        const Json* value = find(key);
        return value ? checked(key, [&] { return value->as_number(); }) : fallback;
    }
    bool boolean_or(std::string_view key, bool fallback) const {
        const Json* value = find(key);
        return value ? checked(key, [&] { return value->as_bool(); }) : fallback;
    }
    std::string string(std::string_view key) const {
        const Json* value = find(key);
        if (!value) fail(file_, ": missing field \"", key, "\"");
        return checked(key, [&] { return value->as_string(); });
    }
    const std::string& file() const { return file_; }

private:
    const Json& json_;
    std::string file_;
};

inline ModelConfig config_from_hugging_face(const Json& json, const std::string& file) {
    ConfigReader read(json, file);
    ModelConfig c;
    c.architecture = read.string("model_type");
    static const std::vector<std::string> supported = {"llama", "mistral", "qwen2", "qwen3"};
    if (std::find(supported.begin(), supported.end(), c.architecture) == supported.end())
        fail(file, ": unsupported model_type \"", c.architecture, "\" (supported: llama, mistral, qwen2, qwen3)");
    if (const Json* act = read.find("hidden_act"); act && act->is_string() && act->as_string() != "silu")
        fail(file, ": unsupported hidden_act \"", act->as_string(), "\" (only silu)");
    c.dim = static_cast<int>(read.integer("hidden_size"));
    c.n_layers = static_cast<int>(read.integer("num_hidden_layers"));
    c.n_heads = static_cast<int>(read.integer("num_attention_heads"));
    c.n_kv_heads = static_cast<int>(read.integer_or("num_key_value_heads", c.n_heads));
    c.ffn_dim = static_cast<int>(read.integer("intermediate_size"));
    c.vocab_size = static_cast<int>(read.integer("vocab_size"));
    c.context_length = static_cast<int>(read.integer_or("max_position_embeddings", 2048));
    if (c.n_heads <= 0) fail(file, ": num_attention_heads must be positive, found ", c.n_heads);
    c.head_dim = static_cast<int>(read.integer_or("head_dim", c.dim / c.n_heads));
    c.rope_theta = read.number_or("rope_theta", 10000.0);
    c.norm_eps = read.number_or("rms_norm_eps", 1e-6);
    c.tied_embeddings = read.boolean_or("tie_word_embeddings", false);
    c.rope_style = RopeStyle::HalfRotation;
    c.qkv_bias = c.architecture == "qwen2" || read.boolean_or("attention_bias", false);
    c.qk_norm = c.architecture == "qwen3";
    if (read.boolean_or("mlp_bias", false)) fail(file, ": mlp_bias true is not supported");
    // Mistral applies its window always; Qwen2 only with use_sliding_window (its configs set the size regardless).
    if (c.architecture == "mistral" || read.boolean_or("use_sliding_window", false))
        c.sliding_window = static_cast<int>(read.integer_or("sliding_window", 0));

    if (const Json* scaling = read.find("rope_scaling")) {
        ConfigReader rope(*scaling, file + " rope_scaling");
        std::string type = rope.find("rope_type") ? rope.string("rope_type") : rope.string("type");
        if (type == "llama3") {
            c.rope_scaling.kind = RopeScaling::Kind::Llama3;
            c.rope_scaling.factor = rope.number_or("factor", 8);
            c.rope_scaling.low_freq_factor = rope.number_or("low_freq_factor", 1);
            c.rope_scaling.high_freq_factor = rope.number_or("high_freq_factor", 4);
            c.rope_scaling.original_context = rope.number_or("original_max_position_embeddings", 8192);
        } else if (type == "linear") {
            c.rope_scaling.kind = RopeScaling::Kind::Linear;
            c.rope_scaling.factor = rope.number_or("factor", 1);
        } else if (type != "default") {
            fail(file, ": unsupported rope_scaling type \"", type, "\" (supported: llama3, linear)");
        }
        if (!(c.rope_scaling.factor > 0)) fail(file, ": rope_scaling factor must be positive");
    }
    if (const Json* bos = read.find("bos_token_id"); bos && bos->is_number()) c.bos_id = static_cast<int>(bos->as_int());
    if (const Json* eos = read.find("eos_token_id")) {
        if (eos->is_number()) c.eos_ids.push_back(static_cast<int>(eos->as_int()));
        else if (eos->is_array())
            for (const Json& id : eos->as_array()) c.eos_ids.push_back(static_cast<int>(id.as_int()));
    }
    return c;
}

}  // namespace detail

// ---- safetensors -----------------------------------------------------------------------------------------------------
// Layout: u64 little-endian header length N, N bytes of JSON {name: {dtype, shape, data_offsets: [begin, end]}}, then
// the raw tensor bytes. data_offsets count from the end of the header. Everything is checked against the file size.

namespace detail {

inline uint64_t read_u64_le(const std::byte* p) {
    uint64_t value = 0;
    for (int i = 7; i >= 0; --i) value = (value << 8) | static_cast<uint8_t>(p[i]);
    return value;
}

inline std::unordered_map<std::string, Tensor> read_safetensors(const MappedFile& file) {
    const std::string& path = file.path();
    if (file.size() < 8) fail(path, ": truncated safetensors file (", file.size(), " bytes, no header length)");
    uint64_t header_length = read_u64_le(file.data());
    if (header_length > file.size() - 8)
        fail(path, ": safetensors header length ", header_length, " runs past the end of the file (", file.size(),
             " bytes)");
    std::string_view header_text(reinterpret_cast<const char*>(file.data() + 8), header_length);
    Json header = Json::parse(header_text, path + " (safetensors header)");
    if (!header.is_object()) fail(path, ": safetensors header is not a JSON object");
    const std::byte* body = file.data() + 8 + header_length;
    const uint64_t body_size = file.size() - 8 - header_length;

    std::unordered_map<std::string, Tensor> tensors;
    for (const auto& [name, info] : header.as_object()) {
        if (name == "__metadata__") continue;
        try {
            Tensor tensor;
            tensor.name = name;
            const std::string& dtype = info.at("dtype").as_string();
            if (dtype == "F32") tensor.dtype = DType::F32;
            else if (dtype == "BF16") tensor.dtype = DType::BF16;
            else if (dtype == "F16") tensor.dtype = DType::F16;
            else fail("unsupported dtype ", dtype, " (supported: F32, BF16, F16)");
            for (const Json& dim : info.at("shape").as_array()) {
                if (dim.as_int() < 0) fail("negative dimension in shape");
                tensor.shape.push_back(dim.as_int());
            }
            const auto& offsets = info.at("data_offsets").as_array();
            if (offsets.size() != 2) fail("data_offsets must have two entries");
            int64_t begin = offsets[0].as_int(), end = offsets[1].as_int();
            if (begin < 0 || end < begin || static_cast<uint64_t>(end) > body_size)
                fail("data_offsets [", begin, ", ", end, "] run past the end of the file (data section is ", body_size,
                     " bytes; the file may be truncated)");
            if (static_cast<uint64_t>(end - begin) != tensor.bytes())
                fail("data_offsets cover ", end - begin, " bytes but shape ", shape_string(tensor.shape), " in ", dtype,
                     " needs ", tensor.bytes());
            tensor.data = body + begin;
            tensors.emplace(name, std::move(tensor));
        } catch (const Error& e) {
            std::string message = e.what();
            if (message.rfind(path, 0) == 0) throw;
            fail(path, ": tensor ", name, ": ", message);
        }
    }
    return tensors;
}

}  // namespace detail

namespace detail {

// Points a Model's weights at tensors named as Hugging Face's Llama/Qwen modeling code names them.
inline void attach_hugging_face_tensors(Model& model, const std::unordered_map<std::string, Tensor>& tensors) {
    auto take = [&](const std::string& name) -> Tensor {
        auto found = tensors.find(name);
        if (found == tensors.end()) fail(model.source, ": missing tensor ", name);
        return found->second;
    };
    const ModelConfig& c = model.config;
    model.embedding = take("model.embed_tokens.weight");
    model.final_norm = take("model.norm.weight");
    // Some tied checkpoints still ship lm_head.weight: the file decides, so the parameter count stays honest.
    model.config.tied_embeddings = c.tied_embeddings && !tensors.count("lm_head.weight");
    model.lm_head = model.config.tied_embeddings ? model.embedding : take("lm_head.weight");
    for (int i = 0; i < c.n_layers; ++i) {
        std::string p = "model.layers." + std::to_string(i) + ".";
        LayerWeights layer;
        layer.attn_norm = take(p + "input_layernorm.weight");
        layer.wq = take(p + "self_attn.q_proj.weight");
        layer.wk = take(p + "self_attn.k_proj.weight");
        layer.wv = take(p + "self_attn.v_proj.weight");
        layer.wo = take(p + "self_attn.o_proj.weight");
        if (c.qkv_bias) {
            layer.bq = take(p + "self_attn.q_proj.bias");
            layer.bk = take(p + "self_attn.k_proj.bias");
            layer.bv = take(p + "self_attn.v_proj.bias");
        }
        if (c.qk_norm) {
            layer.q_norm = take(p + "self_attn.q_norm.weight");
            layer.k_norm = take(p + "self_attn.k_norm.weight");
        }
        layer.ffn_norm = take(p + "post_attention_layernorm.weight");
        layer.w_gate = take(p + "mlp.gate_proj.weight");
        layer.w_up = take(p + "mlp.up_proj.weight");
        layer.w_down = take(p + "mlp.down_proj.weight");
        model.layers.push_back(std::move(layer));
    }
    validate_model(model);
}

}  // namespace detail

// One tensor to write with save_safetensors.
struct TensorData {
    std::string name;
    DType dtype = DType::F32;
    std::vector<int64_t> shape;
    std::vector<std::byte> bytes;
};

inline void save_safetensors(const std::filesystem::path& path, const std::vector<TensorData>& tensors) {
    std::ostringstream header;
    header << "{\"__metadata__\":{\"format\":\"pt\"}";
    uint64_t offset = 0;
    for (const TensorData& t : tensors) {
        header << ',';
        detail::write_json_string(header, t.name);
        header << ":{\"dtype\":\"" << dtype_name(t.dtype) << "\",\"shape\":" << shape_string(t.shape)
               << ",\"data_offsets\":[" << offset << ',' << offset + t.bytes.size() << "]}";
        offset += t.bytes.size();
    }
    header << '}';
    std::string text = header.str();
    while ((text.size() + 8) % 8 != 0) text += ' ';  // the format pads the header so the data starts aligned
    std::ofstream out(path, std::ios::binary);
    if (!out) detail::fail(path.string(), ": cannot create");
    uint64_t length = text.size();
    for (int i = 0; i < 8; ++i) out.put(static_cast<char>((length >> (8 * i)) & 0xFF));
    out << text;
    for (const TensorData& t : tensors) out.write(reinterpret_cast<const char*>(t.bytes.data()), static_cast<std::streamsize>(t.bytes.size()));
    if (!out) detail::fail(path.string(), ": write failed");
}

// A Hugging Face folder: config.json, and model.safetensors or shards listed in model.safetensors.index.json.
inline Model load_hugging_face(const std::filesystem::path& folder) {
    Model model;
    model.source = folder.string();
    model.format = "safetensors";
    auto config_path = folder / "config.json";
    Json config_json = Json::parse(read_text_file(config_path), config_path.string());
    if (!config_json.is_object()) detail::fail(config_path.string(), ": not a JSON object");
    model.config = detail::config_from_hugging_face(config_json, config_path.string());

    std::unordered_map<std::string, Tensor> tensors;
    std::unordered_map<std::string, std::string> tensor_file;  // for messages
    auto add_file = [&](const std::filesystem::path& path) {
        auto file = std::make_shared<MappedFile>(path);
        for (auto& [name, tensor] : detail::read_safetensors(*file)) {
            tensor_file[name] = path.string();
            tensors[name] = std::move(tensor);
        }
        model.files.push_back(std::move(file));
    };
    auto index_path = folder / "model.safetensors.index.json";
    if (std::filesystem::exists(folder / "model.safetensors")) {
        add_file(folder / "model.safetensors");
    } else if (std::filesystem::exists(index_path)) {
        Json index = Json::parse(read_text_file(index_path), index_path.string());
        std::vector<std::string> shards;
        const Json* map = index.find("weight_map");
        if (!map || !map->is_object()) detail::fail(index_path.string(), ": missing object field \"weight_map\"");
        for (const auto& [name, shard] : map->as_object()) {
            if (!shard.is_string()) detail::fail(index_path.string(), ": weight_map entry ", name, " is not a file name");
            if (std::find(shards.begin(), shards.end(), shard.as_string()) == shards.end()) shards.push_back(shard.as_string());
        }
        for (const auto& shard : shards) add_file(folder / shard);
    } else {
        detail::fail(folder.string(), ": no model.safetensors or model.safetensors.index.json");
    }

    detail::attach_hugging_face_tensors(model, tensors);
    return model;
}

// ---- GGUF ------------------------------------------------------------------------------------------------------------
// Layout: "GGUF", u32 version, u64 tensor count, u64 metadata count, metadata (key, type, value)*, tensor infos
// (name, n_dims, dims innermost first, type, offset)*, padding to general.alignment, tensor data. Strings are u64
// length + bytes. Every read is bounds-checked: a truncated or hostile file gets an error, never a wild read.

namespace detail {

class ByteReader {
public:
    explicit ByteReader(const MappedFile& file) : file_(file) {}

    template <class T>
    T read() {
        need(sizeof(T), "a value");
        T value;
        std::memcpy(&value, file_.data() + pos_, sizeof(T));
        pos_ += sizeof(T);
        return value;
    }
    std::string read_string() {
        uint64_t length = read<uint64_t>();
        need(length, "a string");
        std::string text(reinterpret_cast<const char*>(file_.data() + pos_), length);
        pos_ += length;
        return text;
    }
    void need(uint64_t bytes, const char* what) const {
        if (bytes > file_.size() - pos_)
            fail(file_.path(), ": truncated GGUF: ", what, " of ", bytes, " bytes at offset ", pos_, " runs past the end (",
                 file_.size(), " bytes)");
    }
    size_t position() const { return pos_; }
    void seek(size_t pos) { pos_ = pos; }

private:
    const MappedFile& file_;
    size_t pos_ = 0;
};

// GGUF metadata values as one small variant: numbers as double/int64, strings, and arrays of either.
struct GgufValue {
    std::variant<int64_t, double, bool, std::string, std::vector<int64_t>, std::vector<double>, std::vector<std::string>> value;
};

enum GgufType : uint32_t { U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 };

inline int64_t gguf_read_integer(ByteReader& in, uint32_t type) {
    switch (type) {
        case U8: return in.read<uint8_t>();
        case I8: return in.read<int8_t>();
        case U16: return in.read<uint16_t>();
        case I16: return in.read<int16_t>();
        case U32: return in.read<uint32_t>();
        case I32: return in.read<int32_t>();
        case U64: return static_cast<int64_t>(in.read<uint64_t>());
        case I64: return in.read<int64_t>();
        case BOOL: return in.read<uint8_t>() != 0;
    }
    return 0;
}

inline bool gguf_is_integer(uint32_t type) {
    return type <= I32 || type == U64 || type == I64 || type == BOOL;
}

inline GgufValue gguf_read_value(ByteReader& in, uint32_t type, const std::string& path, const std::string& key) {
    GgufValue out;
    if (type == F32) out.value = static_cast<double>(in.read<float>());
    else if (type == F64) out.value = in.read<double>();
    else if (type == BOOL) out.value = in.read<uint8_t>() != 0;
    else if (type == STRING) out.value = in.read_string();
    else if (gguf_is_integer(type)) out.value = gguf_read_integer(in, type);
    else if (type == ARRAY) {
        uint32_t item_type = in.read<uint32_t>();
        uint64_t count = in.read<uint64_t>();
        in.need(count, "an array");  // each item takes at least a byte: a cheap bound before reserving
        if (item_type == STRING) {
            std::vector<std::string> items;
            items.reserve(count);
            for (uint64_t i = 0; i < count; ++i) items.push_back(in.read_string());
            out.value = std::move(items);
        } else if (item_type == F32 || item_type == F64) {
            std::vector<double> items;
            items.reserve(count);
            for (uint64_t i = 0; i < count; ++i) items.push_back(item_type == F32 ? in.read<float>() : in.read<double>());
            out.value = std::move(items);
        } else if (gguf_is_integer(item_type)) {
            std::vector<int64_t> items;
            items.reserve(count);
            for (uint64_t i = 0; i < count; ++i) items.push_back(gguf_read_integer(in, item_type));
            out.value = std::move(items);
        } else {
            fail(path, ": metadata ", key, ": unsupported array item type ", item_type);
        }
    } else {
        fail(path, ": metadata ", key, ": unknown value type ", type);
    }
    return out;
}

inline const char* gguf_tensor_type_name(uint32_t type) {
    static const std::map<uint32_t, const char*> names = {
        {0, "F32"},   {1, "F16"},   {2, "Q4_0"},  {3, "Q4_1"},   {6, "Q5_0"},    {7, "Q5_1"},    {8, "Q8_0"},
        {9, "Q8_1"},  {10, "Q2_K"}, {11, "Q3_K"}, {12, "Q4_K"},  {13, "Q5_K"},   {14, "Q6_K"},   {15, "Q8_K"},
        {16, "IQ2_XXS"}, {17, "IQ2_XS"}, {18, "IQ3_XXS"}, {19, "IQ1_S"}, {20, "IQ4_NL"}, {21, "IQ3_S"}, {22, "IQ2_S"},
        {23, "IQ4_XS"}, {24, "I8"}, {25, "I16"}, {26, "I32"}, {27, "I64"}, {28, "F64"}, {29, "IQ1_M"}, {30, "BF16"},
        {34, "TQ1_0"}, {35, "TQ2_0"}};
    auto found = names.find(type);
    return found == names.end() ? nullptr : found->second;
}

}  // namespace detail

struct GgufFile {
    std::shared_ptr<MappedFile> file;
    uint32_t version = 0;
    std::map<std::string, detail::GgufValue> metadata;
    std::unordered_map<std::string, Tensor> tensors;

    const detail::GgufValue* find(const std::string& key) const {
        auto found = metadata.find(key);
        return found == metadata.end() ? nullptr : &found->second;
    }
    int64_t integer(const std::string& key) const {
        const detail::GgufValue* v = find(key);
        if (!v) detail::fail(file->path(), ": missing GGUF metadata ", key);
        if (auto* i = std::get_if<int64_t>(&v->value)) return *i;
        if (auto* b = std::get_if<bool>(&v->value)) return *b;
        detail::fail(file->path(), ": GGUF metadata ", key, " is not an integer");
    }
    int64_t integer_or(const std::string& key, int64_t fallback) const { return find(key) ? integer(key) : fallback; }
    double number_or(const std::string& key, double fallback) const {
        const detail::GgufValue* v = find(key);
        if (!v) return fallback;
        if (auto* d = std::get_if<double>(&v->value)) return *d;
        if (auto* i = std::get_if<int64_t>(&v->value)) return static_cast<double>(*i);
        detail::fail(file->path(), ": GGUF metadata ", key, " is not a number");
    }
    std::string string_or(const std::string& key, std::string fallback) const {
        const detail::GgufValue* v = find(key);
        if (!v) return fallback;
        if (auto* s = std::get_if<std::string>(&v->value)) return *s;
        detail::fail(file->path(), ": GGUF metadata ", key, " is not a string");
    }
    template <class T>
    const std::vector<T>* array(const std::string& key) const {
        const detail::GgufValue* v = find(key);
        if (!v) return nullptr;
        if (auto* items = std::get_if<std::vector<T>>(&v->value)) return items;
        detail::fail(file->path(), ": GGUF metadata ", key, " is not an array of the expected type");
    }
};

inline GgufFile read_gguf(const std::filesystem::path& path) {
    GgufFile gguf;
    gguf.file = std::make_shared<MappedFile>(path);
    const MappedFile& file = *gguf.file;
    detail::ByteReader in(file);
    if (file.size() < 4 || std::memcmp(file.data(), "GGUF", 4) != 0)
        detail::fail(path.string(), ": not a GGUF file (bad magic; expected \"GGUF\")");
    in.seek(4);
    gguf.version = in.read<uint32_t>();
    if (gguf.version != 2 && gguf.version != 3)
        detail::fail(path.string(), ": unsupported GGUF version ", gguf.version, " (supported: 2, 3)");
    uint64_t tensor_count = in.read<uint64_t>();
    uint64_t metadata_count = in.read<uint64_t>();
    for (uint64_t i = 0; i < metadata_count; ++i) {
        std::string key = in.read_string();
        uint32_t type = in.read<uint32_t>();
        gguf.metadata[key] = detail::gguf_read_value(in, type, path.string(), key);
    }
    struct Info {
        Tensor tensor;
        uint64_t offset;
    };
    std::vector<Info> infos;
    in.need(tensor_count, "the tensor list");
    for (uint64_t i = 0; i < tensor_count; ++i) {
        Info info;
        info.tensor.name = in.read_string();
        uint32_t n_dims = in.read<uint32_t>();
        if (n_dims == 0 || n_dims > 4) detail::fail(path.string(), ": tensor ", info.tensor.name, " has ", n_dims, " dimensions");
        std::vector<int64_t> dims(n_dims);
        for (auto& dim : dims) dim = static_cast<int64_t>(in.read<uint64_t>());
        std::reverse(dims.begin(), dims.end());  // GGUF lists the innermost dimension first
        info.tensor.shape = dims;
        uint32_t type = in.read<uint32_t>();
        if (type == 0) info.tensor.dtype = DType::F32;
        else if (type == 1) info.tensor.dtype = DType::F16;
        else if (type == 30) info.tensor.dtype = DType::BF16;
        else {
            const char* name = detail::gguf_tensor_type_name(type);
            detail::fail(path.string(), ": tensor ", info.tensor.name, " has type ",
                         name ? name : ("unknown (" + std::to_string(type) + ")"),
                         ", which is not supported (supported: F32, F16, BF16)");
        }
        info.offset = in.read<uint64_t>();
        infos.push_back(std::move(info));
    }
    uint64_t alignment = static_cast<uint64_t>(gguf.integer_or("general.alignment", 32));
    if (alignment == 0) detail::fail(path.string(), ": general.alignment is 0");
    uint64_t data_start = (in.position() + alignment - 1) / alignment * alignment;
    for (auto& info : infos) {
        uint64_t bytes = info.tensor.bytes();
        if (data_start > file.size() || info.offset > file.size() - data_start || bytes > file.size() - data_start - info.offset)
            detail::fail(path.string(), ": tensor ", info.tensor.name, " (", bytes, " bytes at data offset ", info.offset,
                         ") runs past the end of the file (", file.size(), " bytes; truncated?)");
        info.tensor.data = file.data() + data_start + info.offset;
        gguf.tensors[info.tensor.name] = std::move(info.tensor);
    }
    return gguf;
}

namespace detail {

inline Vocabulary vocabulary_from_gguf(const GgufFile& gguf) {
    Vocabulary vocab;
    const std::string path = gguf.file->path();
    std::string kind = gguf.string_or("tokenizer.ggml.model", "");
    if (kind.empty()) return vocab;
    if (kind != "llama")
        return vocab;  // byte-level BPE vocabularies ("gpt2") arrive with the tokenizer layer; ids still work
    const auto* tokens = gguf.array<std::string>("tokenizer.ggml.tokens");
    if (!tokens) fail(path, ": missing GGUF metadata tokenizer.ggml.tokens");
    vocab.pieces = *tokens;
    if (const auto* scores = gguf.array<double>("tokenizer.ggml.scores")) {
        if (scores->size() != tokens->size()) fail(path, ": tokenizer.ggml.scores has ", scores->size(), " entries for ", tokens->size(), " tokens");
        vocab.scores.assign(scores->begin(), scores->end());
    } else {
        vocab.scores.assign(tokens->size(), 0.0f);
    }
    vocab.types.assign(tokens->size(), Vocabulary::Type::Normal);
    if (const auto* types = gguf.array<int64_t>("tokenizer.ggml.token_type")) {
        if (types->size() != tokens->size()) fail(path, ": tokenizer.ggml.token_type has ", types->size(), " entries for ", tokens->size(), " tokens");
        for (size_t i = 0; i < types->size(); ++i) vocab.types[i] = static_cast<Vocabulary::Type>((*types)[i]);
    }
    vocab.unk_id = static_cast<int>(gguf.integer_or("tokenizer.ggml.unknown_token_id", 0));
    vocab.add_bos = gguf.integer_or("tokenizer.ggml.add_bos_token", 1) != 0;
    vocab.add_space_prefix = gguf.integer_or("tokenizer.ggml.add_space_prefix", 1) != 0;
    return vocab;
}

}  // namespace detail

inline Model load_gguf(const std::filesystem::path& path) {
    GgufFile gguf = read_gguf(path);
    Model model;
    model.source = path.string();
    model.format = "gguf";
    model.files.push_back(gguf.file);
    ModelConfig& c = model.config;
    c.architecture = gguf.string_or("general.architecture", "");
    if (c.architecture != "llama" && c.architecture != "qwen2" && c.architecture != "qwen3")
        detail::fail(model.source, ": unsupported general.architecture \"", c.architecture,
                     "\" (supported: llama, qwen2, qwen3)");
    const std::string a = c.architecture + ".";
    c.dim = static_cast<int>(gguf.integer(a + "embedding_length"));
    c.n_layers = static_cast<int>(gguf.integer(a + "block_count"));
    c.ffn_dim = static_cast<int>(gguf.integer(a + "feed_forward_length"));
    c.n_heads = static_cast<int>(gguf.integer(a + "attention.head_count"));
    c.n_kv_heads = static_cast<int>(gguf.integer_or(a + "attention.head_count_kv", c.n_heads));
    if (c.n_heads <= 0) detail::fail(model.source, ": ", a, "attention.head_count must be positive");
    c.head_dim = static_cast<int>(gguf.integer_or(a + "attention.key_length", c.dim / c.n_heads));
    c.context_length = static_cast<int>(gguf.integer_or(a + "context_length", 2048));
    c.rope_theta = gguf.number_or(a + "rope.freq_base", 10000.0);
    c.norm_eps = gguf.number_or(a + "attention.layer_norm_rms_epsilon", 1e-5);
    c.rope_style = c.architecture == "llama" ? RopeStyle::AdjacentPairs : RopeStyle::HalfRotation;
    c.qkv_bias = c.architecture == "qwen2";
    c.qk_norm = c.architecture == "qwen3";
    std::string scaling = gguf.string_or(a + "rope.scaling.type", "none");
    if (scaling == "linear") {
        c.rope_scaling.kind = RopeScaling::Kind::Linear;
        c.rope_scaling.factor = gguf.number_or(a + "rope.scaling.factor", 1);
    } else if (scaling != "none" && scaling != "yarn") {
        detail::fail(model.source, ": unsupported ", a, "rope.scaling.type \"", scaling, "\"");
    } else if (scaling == "yarn") {
        detail::fail(model.source, ": unsupported ", a, "rope.scaling.type \"yarn\"");
    }
    c.bos_id = static_cast<int>(gguf.integer_or("tokenizer.ggml.bos_token_id", -1));
    if (gguf.find("tokenizer.ggml.eos_token_id")) c.eos_ids.push_back(static_cast<int>(gguf.integer("tokenizer.ggml.eos_token_id")));
    if (gguf.find("tokenizer.ggml.eot_token_id")) {
        int eot = static_cast<int>(gguf.integer("tokenizer.ggml.eot_token_id"));
        if (std::find(c.eos_ids.begin(), c.eos_ids.end(), eot) == c.eos_ids.end()) c.eos_ids.push_back(eot);
    }

    auto take = [&](const std::string& name) -> Tensor {
        auto found = gguf.tensors.find(name);
        if (found == gguf.tensors.end()) detail::fail(model.source, ": missing tensor ", name);
        return found->second;
    };
    model.embedding = take("token_embd.weight");
    c.vocab_size = static_cast<int>(model.embedding.rows());
    model.final_norm = take("output_norm.weight");
    c.tied_embeddings = !gguf.tensors.count("output.weight");
    model.lm_head = c.tied_embeddings ? model.embedding : take("output.weight");
    for (int i = 0; i < c.n_layers; ++i) {
        std::string p = "blk." + std::to_string(i) + ".";
        LayerWeights layer;
        layer.attn_norm = take(p + "attn_norm.weight");
        layer.wq = take(p + "attn_q.weight");
        layer.wk = take(p + "attn_k.weight");
        layer.wv = take(p + "attn_v.weight");
        layer.wo = take(p + "attn_output.weight");
        if (c.qkv_bias) {
            layer.bq = take(p + "attn_q.bias");
            layer.bk = take(p + "attn_k.bias");
            layer.bv = take(p + "attn_v.bias");
        }
        if (c.qk_norm) {
            layer.q_norm = take(p + "attn_q_norm.weight");
            layer.k_norm = take(p + "attn_k_norm.weight");
        }
        layer.ffn_norm = take(p + "ffn_norm.weight");
        layer.w_gate = take(p + "ffn_gate.weight");
        layer.w_up = take(p + "ffn_up.weight");
        layer.w_down = take(p + "ffn_down.weight");
        model.layers.push_back(std::move(layer));
    }
    // Llama 3's frequency scaling is baked into the file as per-frequency divisors.
    if (auto found = gguf.tensors.find("rope_freqs.weight"); found != gguf.tensors.end()) {
        const Tensor& freqs = found->second;
        for (int64_t i = 0; i < freqs.elements(); ++i) model.rope_freq_divisors.push_back(freqs.at(i));
    }
    model.vocab = detail::vocabulary_from_gguf(gguf);
    detail::validate_model(model);
    return model;
}

// ---- llama2.c --------------------------------------------------------------------------------------------------------
// Karpathy's legacy format: 7 int32 (dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len; a negative
// vocab_size means a separate classifier), then float32 arrays with all layers of one kind stored together. Its q/k
// rows use adjacent-pair RoPE. The vocabulary lives in a separate tokenizer.bin.

inline Vocabulary load_llama2c_tokenizer(const std::filesystem::path& path, int vocab_size) {
    MappedFile file(path);
    detail::ByteReader in(file);  // the same bounds-checked little-endian reads
    Vocabulary vocab;
    in.read<uint32_t>();           // max_token_length: not needed
    for (int id = 0; id < vocab_size; ++id) {
        float score = in.read<float>();
        int32_t length = in.read<int32_t>();
        if (length < 0) detail::fail(path.string(), ": token ", id, " has negative length ", length);
        in.need(static_cast<uint64_t>(length), "a token");
        std::string piece(reinterpret_cast<const char*>(file.data() + in.position()), static_cast<size_t>(length));
        in.seek(in.position() + static_cast<size_t>(length));
        // The file stores "▁" as a space and BOS/EOS as "\n<s>\n" / "\n</s>\n": restore SentencePiece's spelling.
        auto type = Vocabulary::Type::Normal;
        if (id == 0) type = Vocabulary::Type::Unknown;
        else if (id == 1 || id == 2) {
            type = Vocabulary::Type::Control;
            piece.erase(std::remove(piece.begin(), piece.end(), '\n'), piece.end());
        } else if (piece.size() == 6 && piece.rfind("<0x", 0) == 0 && piece[5] == '>') {
            type = Vocabulary::Type::Byte;
        } else {
            std::string restored;
            for (char ch : piece) restored += ch == ' ' ? std::string("\xE2\x96\x81") : std::string(1, ch);
            piece = restored;
        }
        vocab.pieces.push_back(piece);
        vocab.scores.push_back(score);
        vocab.types.push_back(type);
    }
    return vocab;
}

inline Model load_llama2c(const std::filesystem::path& path, const std::filesystem::path& tokenizer_path) {
    Model model;
    model.source = path.string();
    model.format = "llama2.c";
    auto file = std::make_shared<MappedFile>(path);
    model.files.push_back(file);
    if (file->size() < 28) detail::fail(model.source, ": too small for a llama2.c header (", file->size(), " bytes)");
    int32_t header[7];
    std::memcpy(header, file->data(), sizeof header);
    ModelConfig& c = model.config;
    c.architecture = "llama";
    c.dim = header[0];
    c.ffn_dim = header[1];
    c.n_layers = header[2];
    c.n_heads = header[3];
    c.n_kv_heads = header[4];
    c.vocab_size = std::abs(header[5]);
    c.context_length = header[6];
    c.tied_embeddings = header[5] > 0;
    if (c.n_heads <= 0 || c.dim <= 0) detail::fail(model.source, ": bad llama2.c header (dim ", c.dim, ", heads ", c.n_heads, ")");
    c.head_dim = c.dim / c.n_heads;
    c.rope_style = RopeStyle::AdjacentPairs;
    c.rope_theta = 10000;
    c.norm_eps = 1e-5;
    c.bos_id = 1;
    c.eos_ids = {2, 1};  // run.c ends a story when the model starts the next one with BOS
    detail::validate_config(c, model.source);

    const int64_t D = c.dim, F = c.ffn_dim, L = c.n_layers, V = c.vocab_size, S = c.context_length;
    const int64_t q_width = int64_t{c.n_heads} * c.head_dim, kv_width = int64_t{c.n_kv_heads} * c.head_dim;
    const int64_t floats = V * D + L * D + L * D * q_width + 2 * L * D * kv_width + L * q_width * D + L * D +
                           3 * L * F * D + D + S * c.head_dim + (c.tied_embeddings ? 0 : V * D);
    const uint64_t expected = 28 + static_cast<uint64_t>(floats) * 4;
    if (file->size() != expected)
        detail::fail(model.source, ": llama2.c file is ", file->size(), " bytes but its header (dim ", D, ", hidden ", F,
                     ", layers ", L, ", heads ", c.n_heads, ", kv heads ", c.n_kv_heads, ", vocab ", V, ", seq_len ", S,
                     ") needs ", expected);

    const std::byte* cursor = file->data() + 28;
    auto next = [&](const char* name, std::vector<int64_t> shape) {
        Tensor t{name, DType::F32, std::move(shape), cursor};
        cursor += t.bytes();
        return t;
    };
    // Per-layer views into one array per kind: layer i starts i × (size of one layer's tensor) further.
    auto per_layer = [&](const char* name, std::vector<int64_t> shape, auto member) {
        Tensor all = next(name, {L * std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<int64_t>())});
        model.layers.resize(static_cast<size_t>(L));
        for (int64_t i = 0; i < L; ++i) {
            Tensor& t = model.layers[static_cast<size_t>(i)].*member;
            t = Tensor{std::string(name) + "[" + std::to_string(i) + "]", DType::F32, shape, all.data + i * (all.bytes() / L)};
        }
    };
    model.embedding = next("token_embedding_table", {V, D});
    per_layer("rms_att_weight", {D}, &LayerWeights::attn_norm);
    per_layer("wq", {q_width, D}, &LayerWeights::wq);
    per_layer("wk", {kv_width, D}, &LayerWeights::wk);
    per_layer("wv", {kv_width, D}, &LayerWeights::wv);
    per_layer("wo", {D, q_width}, &LayerWeights::wo);
    per_layer("rms_ffn_weight", {D}, &LayerWeights::ffn_norm);
    per_layer("w1", {F, D}, &LayerWeights::w_gate);
    per_layer("w2", {D, F}, &LayerWeights::w_down);
    per_layer("w3", {F, D}, &LayerWeights::w_up);
    model.final_norm = next("rms_final_weight", {D});
    next("freq_cis", {S * c.head_dim});  // precomputed RoPE tables: we compute our own
    model.lm_head = c.tied_embeddings ? model.embedding : next("wcls", {V, D});
    if (!tokenizer_path.empty()) model.vocab = load_llama2c_tokenizer(tokenizer_path, c.vocab_size);
    detail::validate_model(model);
    return model;
}

// Picks the loader from what the path is: a folder (Hugging Face), a file starting with "GGUF", or a llama2.c .bin
// (whose tokenizer defaults to tokenizer.bin beside it).
inline Model load_model(const std::filesystem::path& path, std::filesystem::path tokenizer_path = {}) {
    if (!std::filesystem::exists(path)) detail::fail(path.string(), ": no such file or folder");
    Model model;
    if (std::filesystem::is_directory(path)) {
        model = load_hugging_face(path);
    } else {
        char magic[4] = {};
        std::ifstream(path, std::ios::binary).read(magic, 4);
        if (std::memcmp(magic, "GGUF", 4) == 0 || detail::ends_with(path.string(), ".gguf")) {
            model = load_gguf(path);
        } else {
            if (tokenizer_path.empty()) {
                tokenizer_path = path.parent_path() / "tokenizer.bin";
                if (!std::filesystem::exists(tokenizer_path)) tokenizer_path.clear();  // ids only, then
            }
            model = load_llama2c(path, tokenizer_path);
        }
    }
    return model;
}

// =====================================================================================================================
// 3. TOKENIZER — text to token ids and back. This section holds the SentencePiece score-based BPE that llama2.c files
//    and GGUF "llama" vocabularies use: split the text into characters, then repeatedly merge the adjacent pair whose
//    merged piece has the highest score. A priority queue keeps that O(n log n) in the text's length. Characters with
//    no piece fall back to byte tokens <0x00>..<0xFF>. Cost: microseconds per prompt, negligible next to prefill.
//    Chapter 03 covers it (and the Hugging Face tokenizer.json families, which arrive with the tokenizer layer).
// =====================================================================================================================

namespace detail {

// Length of the UTF-8 sequence that starts with `lead`, or 0 for a byte that cannot start one.
inline int utf8_sequence_length(unsigned char lead) {
    if (lead < 0x80) return 1;
    if ((lead & 0xE0) == 0xC0) return lead >= 0xC2 ? 2 : 0;
    if ((lead & 0xF0) == 0xE0) return 3;
    if ((lead & 0xF8) == 0xF0) return lead <= 0xF4 ? 4 : 0;
    return 0;
}

// Byte offset of the first invalid UTF-8 sequence in `text`, or npos when it is all valid.
inline size_t find_invalid_utf8(std::string_view text) {
    size_t i = 0;
    while (i < text.size()) {
        auto lead = static_cast<unsigned char>(text[i]);
        int length = utf8_sequence_length(lead);
        if (length == 0 || i + length > text.size()) return i;
        for (int k = 1; k < length; ++k)
            if ((static_cast<unsigned char>(text[i + k]) & 0xC0) != 0x80) return i;
        // Reject overlong forms, surrogates and code points past U+10FFFF.
        auto second = static_cast<unsigned char>(length > 1 ? text[i + 1] : 0);
        if ((lead == 0xE0 && second < 0xA0) || (lead == 0xED && second >= 0xA0) || (lead == 0xF0 && second < 0x90) ||
            (lead == 0xF4 && second >= 0x90))
            return i;
        i += static_cast<size_t>(length);
    }
    return std::string_view::npos;
}

}  // namespace detail

class Tokenizer {
public:
    Tokenizer() = default;
    Tokenizer(const Vocabulary& vocab, int bos_id, std::string source) : vocab_(&vocab), bos_id_(bos_id), source_(std::move(source)) {
        for (size_t id = 0; id < vocab.pieces.size(); ++id) {
            const std::string& piece = vocab.pieces[id];
            piece_to_id_.emplace(piece, static_cast<int>(id));
            auto type = vocab.types[id];
            if (type == Vocabulary::Type::Byte) byte_to_id_[std::stoi(piece.substr(3, 2), nullptr, 16)] = static_cast<int>(id);
            // Pieces matched whole in the input text (parse_special in llama.cpp): control, user-defined, unknown.
            if ((type == Vocabulary::Type::Control || type == Vocabulary::Type::UserDefined ||
                 type == Vocabulary::Type::Unknown) && !piece.empty())
                special_ids_.push_back(static_cast<int>(id));
        }
        // Longest first, so "<|end|>" is not cut short by a shorter special that prefixes it.
        std::stable_sort(special_ids_.begin(), special_ids_.end(),
                         [&](int a, int b) { return vocab.pieces[a].size() > vocab.pieces[b].size(); });
    }

    int vocab_size() const { return static_cast<int>(vocab_->pieces.size()); }
    int bos_id() const { return bos_id_; }

    // Text to ids. With add_bos the model's BOS comes first (when its vocabulary asks for one).
    std::vector<int> encode(std::string_view text, bool add_bos = true) const {
        if (size_t bad = detail::find_invalid_utf8(text); bad != std::string_view::npos)
            detail::fail("invalid UTF-8 in the input text at byte offset ", bad);
        std::vector<int> ids;
        if (add_bos && vocab_->add_bos && bos_id_ >= 0) ids.push_back(bos_id_);
        // Split around special tokens; each stretch of plain text gets SentencePiece's dummy-prefix space when it
        // starts the text or follows a special token, as llama.cpp does.
        bool after_special = true;
        size_t start = 0;
        while (start <= text.size()) {
            size_t match_at = text.size();
            int match_id = -1;
            for (size_t i = start; i < text.size() && match_id < 0; ++i)
                for (int id : special_ids_) {
                    const std::string& piece = vocab_->pieces[id];
                    if (text.compare(i, piece.size(), piece) == 0) {
                        match_at = i;
                        match_id = id;
                        break;
                    }
                }
            std::string_view plain = text.substr(start, match_at - start);
            if (!plain.empty()) encode_plain(plain, after_special, ids);
            if (match_id < 0) break;
            ids.push_back(match_id);
            after_special = true;
            start = match_at + vocab_->pieces[match_id].size();
        }
        return ids;
    }

    // The bytes one token stands for: "▁" becomes a space, <0xNN> the raw byte, control tokens nothing.
    // `previous` decides SentencePiece's rule that a leading space after BOS (the dummy prefix) is dropped.
    std::string token_bytes(int id, int previous = -1) const {
        if (id < 0 || id >= vocab_size()) detail::fail("token id ", id, " is outside the vocabulary (", vocab_size(), " tokens)");
        auto type = vocab_->types[id];
        if (type == Vocabulary::Type::Control || type == Vocabulary::Type::Unused) return "";
        const std::string& piece = vocab_->pieces[id];
        if (type == Vocabulary::Type::Byte) return std::string(1, static_cast<char>(std::stoi(piece.substr(3, 2), nullptr, 16)));
        std::string text;
        static constexpr std::string_view space_marker = "\xE2\x96\x81";  // ▁
        for (size_t i = 0; i < piece.size();) {
            if (piece.compare(i, space_marker.size(), space_marker) == 0) {
                text += ' ';
                i += space_marker.size();
            } else {
                text += piece[i++];
            }
        }
        bool starts_text = previous < 0 || previous == bos_id_;
        if (starts_text && vocab_->add_space_prefix && !text.empty() && text[0] == ' ') text.erase(0, 1);
        return text;
    }

    std::string decode(std::span<const int> ids) const {
        std::string text;
        int previous = -1;
        for (int id : ids) {
            text += token_bytes(id, previous);
            previous = id;
        }
        return text;
    }

private:
    void encode_plain(std::string_view plain, bool dummy_prefix, std::vector<int>& ids) const {
        std::string text;
        if (dummy_prefix && vocab_->add_space_prefix) text += "\xE2\x96\x81";
        for (char ch : plain) {
            if (ch == ' ') text += "\xE2\x96\x81";
            else text += ch;
        }
        // One symbol per UTF-8 character, kept as a doubly linked list so merges are O(1).
        struct Symbol {
            size_t begin, length;
            int prev, next;
        };
        std::vector<Symbol> symbols;
        for (size_t i = 0; i < text.size();) {
            size_t length = std::min<size_t>(detail::utf8_sequence_length(static_cast<unsigned char>(text[i])), text.size() - i);
            int index = static_cast<int>(symbols.size());
            symbols.push_back({i, length, index - 1, index + 1});
            i += length;
        }
        if (symbols.empty()) return;
        symbols.back().next = -1;

        // Candidate merges, best score first, leftmost first on ties. A candidate goes stale when either side has
        // merged since it was queued: its recorded length no longer matches.
        struct Candidate {
            float score;
            int left, right;
            size_t length;
        };
        auto worse = [](const Candidate& a, const Candidate& b) {
            return a.score < b.score || (a.score == b.score && a.left > b.left);
        };
        std::vector<Candidate> queue;
        auto consider = [&](int left, int right) {
            if (left < 0 || right < 0) return;
            std::string_view merged(text.data() + symbols[left].begin, symbols[left].length + symbols[right].length);
            auto found = piece_to_id_.find(std::string(merged));
            if (found == piece_to_id_.end()) return;
            queue.push_back({vocab_->scores[found->second], left, right, merged.size()});
            std::push_heap(queue.begin(), queue.end(), worse);
        };
        for (size_t i = 1; i < symbols.size(); ++i) consider(static_cast<int>(i) - 1, static_cast<int>(i));
        while (!queue.empty()) {
            std::pop_heap(queue.begin(), queue.end(), worse);
            Candidate best = queue.back();
            queue.pop_back();
            Symbol& left = symbols[best.left];
            Symbol& right = symbols[best.right];
            if (left.length == 0 || right.length == 0 || left.length + right.length != best.length) continue;
            left.length += right.length;
            right.length = 0;
            left.next = right.next;
            if (right.next >= 0) symbols[right.next].prev = best.left;
            consider(left.prev, best.left);
            consider(best.left, left.next);
        }
        for (int i = 0; i >= 0; i = symbols[i].next) {
            std::string piece = text.substr(symbols[i].begin, symbols[i].length);
            if (auto found = piece_to_id_.find(piece); found != piece_to_id_.end()) {
                ids.push_back(found->second);
                continue;
            }
            for (unsigned char byte : piece) {  // byte fallback, or <unk> for a vocabulary without byte tokens
                int id = byte_to_id_[byte];
                ids.push_back(id >= 0 ? id : vocab_->unk_id);
            }
        }
    }

    const Vocabulary* vocab_ = nullptr;
    int bos_id_ = -1;
    std::string source_;
    std::unordered_map<std::string, int> piece_to_id_;
    std::array<int, 256> byte_to_id_ = [] {
        std::array<int, 256> none;
        none.fill(-1);
        return none;
    }();
    std::vector<int> special_ids_;
};

// Feeds token ids one at a time and returns the text each one completes. A byte-fallback token can end in the middle of
// a multi-byte character; those bytes wait until the character is whole, so the stream never prints half a character
// and its concatenation equals a full decode. Bytes that can never form a character become U+FFFD.
class TextStream {
public:
    explicit TextStream(const Tokenizer& tokenizer, int previous = -1) : tokenizer_(&tokenizer), previous_(previous) {}

    std::string push(int id) {
        pending_ += tokenizer_->token_bytes(id, previous_);
        previous_ = id;
        return take_complete(false);
    }
    std::string finish() { return take_complete(true); }

private:
    std::string take_complete(bool at_end) {
        std::string out;
        size_t i = 0;
        while (i < pending_.size()) {
            int length = detail::utf8_sequence_length(static_cast<unsigned char>(pending_[i]));
            if (length == 0) {
                out += "\xEF\xBF\xBD";
                ++i;
                continue;
            }
            if (i + length > pending_.size()) {
                bool could_complete = true;
                for (size_t k = i + 1; k < pending_.size(); ++k)
                    if ((static_cast<unsigned char>(pending_[k]) & 0xC0) != 0x80) could_complete = false;
                if (!at_end && could_complete) break;  // wait for the rest of the character
                out += "\xEF\xBF\xBD";
                ++i;
                continue;
            }
            std::string_view sequence = std::string_view(pending_).substr(i, length);
            if (detail::find_invalid_utf8(sequence) != std::string_view::npos) {
                out += "\xEF\xBF\xBD";
                ++i;
                continue;
            }
            out += sequence;
            i += length;
        }
        pending_.erase(0, i);
        return out;
    }

    const Tokenizer* tokenizer_;
    int previous_;
    std::string pending_;
};

// =====================================================================================================================
// 4. KV CACHE — each layer's keys and values for every token a sequence has seen, so decode computes one new token's
//    K/V instead of the whole prefix again. Memory is a pool of fixed-size blocks (B tokens each); a sequence owns a
//    block table that maps position p to block table[p / B], slot p % B, so sequences grow without copying and without
//    reserving their maximum length up front. Cost: 2 × L × Hkv × Dh × 4 bytes per token (f32).  (chapter 05)
// =====================================================================================================================

class KVCache {
public:
    KVCache(const ModelConfig& config, int num_blocks, int block_size = 16)
        : layers_(config.n_layers), block_size_(block_size), num_blocks_(num_blocks),
          token_width_(config.n_kv_heads * config.head_dim) {
        if (block_size <= 0) detail::fail("KV cache block size must be positive, found ", block_size);
        if (num_blocks <= 0) detail::fail("KV cache needs at least one block, found ", num_blocks);
        size_t floats = static_cast<size_t>(layers_) * num_blocks_ * block_size_ * token_width_;
        keys_.assign(floats, 0.0f);
        values_.assign(floats, 0.0f);
        for (int block = num_blocks_ - 1; block >= 0; --block) free_blocks_.push_back(block);
    }

    // Bytes one token occupies across all layers (keys and values).
    static size_t bytes_per_token(const ModelConfig& c) {
        return 2 * sizeof(float) * static_cast<size_t>(c.n_layers) * c.n_kv_heads * c.head_dim;
    }

    int block_size() const { return block_size_; }
    int num_blocks() const { return num_blocks_; }
    int free_block_count() const { return static_cast<int>(free_blocks_.size()); }
    int capacity_tokens() const { return num_blocks_ * block_size_; }

    // Grows a sequence's block table to hold positions [0, n_tokens). Returns false, changing nothing, when the pool
    // has too few free blocks: running out is an expected outcome the scheduler handles, not an error.
    bool reserve(int sequence, int n_tokens) {
        std::vector<int>& table = tables_[sequence];
        size_t needed = static_cast<size_t>((n_tokens + block_size_ - 1) / block_size_);
        if (needed <= table.size()) return true;
        if (needed - table.size() > free_blocks_.size()) return false;
        while (table.size() < needed) {
            table.push_back(free_blocks_.back());
            free_blocks_.pop_back();
        }
        return true;
    }

    void release(int sequence) {
        auto found = tables_.find(sequence);
        if (found == tables_.end()) return;
        for (int block : found->second) free_blocks_.push_back(block);
        tables_.erase(found);
    }

    const std::vector<int>& block_table(int sequence) const {
        auto found = tables_.find(sequence);
        if (found == tables_.end()) detail::fail("KV cache: sequence ", sequence, " has no blocks");
        return found->second;
    }

    // [Hkv × Dh] keys or values of one token: layer, block, slot.
    float* key(int layer, int block, int slot) { return keys_.data() + offset(layer, block, slot); }
    float* value(int layer, int block, int slot) { return values_.data() + offset(layer, block, slot); }
    const float* key(int layer, int block, int slot) const { return keys_.data() + offset(layer, block, slot); }
    const float* value(int layer, int block, int slot) const { return values_.data() + offset(layer, block, slot); }

private:
    size_t offset(int layer, int block, int slot) const {
        return ((static_cast<size_t>(layer) * num_blocks_ + block) * block_size_ + slot) * token_width_;
    }

    int layers_, block_size_, num_blocks_, token_width_;
    std::vector<float> keys_, values_;  // [L, num_blocks, B, Hkv, Dh]
    std::vector<int> free_blocks_;
    std::unordered_map<int, std::vector<int>> tables_;
};

// =====================================================================================================================
// 5. FORWARD PASS — token ids in, next-token logits out. One function serves prefill (a whole prompt: T rows, so each
//    weight read from memory is used T times: matrix-matrix, compute-bound) and decode (one token per sequence: every
//    weight byte is read for a handful of multiply-adds: matrix-vector, memory-bound). Per layer:
//      x → RMSNorm → q,k,v projections (+bias, +per-head norm) → RoPE → write K/V to the cache → attention over the
//      sequence's cached positions (GQA: query head h reads KV head h / (H / Hkv)) → output projection → + x
//        → RMSNorm → SwiGLU MLP: down(silu(gate(x)) · up(x)) → + x
//    then the final norm and the vocabulary projection.  Chapter 04 measures both regimes.
// =====================================================================================================================

// The tokens of one forward call: each with the sequence it belongs to and its position in that sequence. Tokens of
// many sequences, decoding or prefilling, can share a batch; a token sees only its own sequence's cache.
struct Batch {
    std::vector<int> tokens;     // [T]
    std::vector<int> positions;  // [T]
    std::vector<int> sequences;  // [T]
    std::vector<char> wants_logits;  // [T] logits are computed only where asked (the last prompt token, decode tokens)

    void add(int token, int position, int sequence, bool logits) {
        tokens.push_back(token);
        positions.push_back(position);
        sequences.push_back(sequence);
        wants_logits.push_back(logits);
    }
    void clear() {
        tokens.clear();
        positions.clear();
        sequences.clear();
        wants_logits.clear();
    }
    size_t size() const { return tokens.size(); }
};

namespace detail {

// ---- The matmul kernel: one weight row against up to four activation rows ----
// Each output's sum is built the same way whatever else is in the batch (two 8-wide accumulators over 16 columns at a
// time, then a fixed-order tail), so a sequence's logits do not depend on its batch-mates: batch invariance.

#ifdef INFER_HAVE_AVX2
template <DType dtype>
inline void load16(const std::byte* row, size_t k, __m256& low, __m256& high) {
    if constexpr (dtype == DType::F32) {
        const float* w = reinterpret_cast<const float*>(row) + k;
        low = _mm256_loadu_ps(w);
        high = _mm256_loadu_ps(w + 8);
    } else {
        const uint16_t* w = reinterpret_cast<const uint16_t*>(row) + k;
        __m128i first = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
        __m128i second = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 8));
        if constexpr (dtype == DType::BF16) {  // bf16 → f32 is a 16-bit shift, done in registers
            low = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(first), 16));
            high = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(second), 16));
        } else {
            low = _mm256_cvtph_ps(first);
            high = _mm256_cvtph_ps(second);
        }
    }
}

inline float horizontal_sum(__m256 v) {
    __m128 sum = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
    sum = _mm_add_ss(sum, _mm_movehdup_ps(sum));
    return _mm_cvtss_f32(sum);
}
#endif

template <DType dtype>
inline float weight_at(const std::byte* row, size_t k) {
    if constexpr (dtype == DType::F32) {
        float value;
        std::memcpy(&value, row + k * 4, 4);
        return value;
    } else {
        uint16_t half;
        std::memcpy(&half, row + k * 2, 2);
        return dtype == DType::BF16 ? bf16_to_f32(half) : f16_to_f32(half);
    }
}

// out[j * out_stride] = dot(row, x + j * x_stride) for j < NT.
template <DType dtype, int NT>
inline void dot_row(const std::byte* row, const float* x, size_t x_stride, size_t K, float* out, size_t out_stride) {
    const size_t K16 = K / 16 * 16;
    float sums[NT];
#ifdef INFER_HAVE_AVX2
    __m256 acc_low[NT], acc_high[NT];
    for (int j = 0; j < NT; ++j) acc_low[j] = acc_high[j] = _mm256_setzero_ps();
    for (size_t k = 0; k < K16; k += 16) {
        __m256 w_low, w_high;
        load16<dtype>(row, k, w_low, w_high);
        for (int j = 0; j < NT; ++j) {
            acc_low[j] = _mm256_fmadd_ps(w_low, _mm256_loadu_ps(x + j * x_stride + k), acc_low[j]);
            acc_high[j] = _mm256_fmadd_ps(w_high, _mm256_loadu_ps(x + j * x_stride + k + 8), acc_high[j]);
        }
    }
    for (int j = 0; j < NT; ++j) sums[j] = horizontal_sum(_mm256_add_ps(acc_low[j], acc_high[j]));
#else
    // The portable twin: sixteen lanes per token, which compilers turn into vector registers.
    float lanes[NT][16] = {};
    for (size_t k = 0; k < K16; k += 16)
        for (int j = 0; j < NT; ++j)
            for (int lane = 0; lane < 16; ++lane) lanes[j][lane] += weight_at<dtype>(row, k + lane) * x[j * x_stride + k + lane];
    for (int j = 0; j < NT; ++j) {
        float half[8];
        for (int lane = 0; lane < 8; ++lane) half[lane] = lanes[j][lane] + lanes[j][lane + 8];
        sums[j] = ((half[0] + half[4]) + (half[2] + half[6])) + ((half[1] + half[5]) + (half[3] + half[7]));
    }
#endif
    for (size_t k = K16; k < K; ++k) {
        float w = weight_at<dtype>(row, k);
        for (int j = 0; j < NT; ++j) sums[j] += w * x[j * x_stride + k];
    }
    for (int j = 0; j < NT; ++j) out[j * out_stride] = sums[j];
}

template <DType dtype>
inline void matmul_rows(const Tensor& w, const float* x, int T, float* out, size_t row_begin, size_t row_end) {
    const size_t K = static_cast<size_t>(w.cols()), N = static_cast<size_t>(w.rows());
    const size_t row_bytes = K * dtype_size(dtype);
    constexpr size_t rows_per_tile = 16;  // 16 weight rows stay in L1/L2 while every token tile passes over them
    for (size_t tile = row_begin; tile < row_end; tile += rows_per_tile) {
        size_t tile_end = std::min(row_end, tile + rows_per_tile);
        for (int t = 0; t < T; t += 4) {
            int count = std::min(4, T - t);
            const float* xt = x + static_cast<size_t>(t) * K;
            for (size_t n = tile; n < tile_end; ++n) {
                const std::byte* row = w.data + n * row_bytes;
                float* o = out + static_cast<size_t>(t) * N + n;
                switch (count) {
                    case 4: dot_row<dtype, 4>(row, xt, K, K, o, N); break;
                    case 3: dot_row<dtype, 3>(row, xt, K, K, o, N); break;
                    case 2: dot_row<dtype, 2>(row, xt, K, K, o, N); break;
                    default: dot_row<dtype, 1>(row, xt, K, K, o, N); break;
                }
            }
        }
    }
}

// One product of a matmul call: out[T, N] = x[T, K] · w[N, K]ᵀ (+ bias[N]).
struct Product {
    const Tensor& w;
    float* out;
    const Tensor* bias = nullptr;
};

// Products that share their input x[T, K] (q, k and v; gate and up) run as one parallel section: their rows are laid
// end to end and split across threads, so each weight row is read from memory once and the pool wakes once.
inline void matmul(ThreadPool& pool, const float* x, int T, std::initializer_list<Product> products) {
    size_t total_rows = 0;
    for (const Product& p : products) total_rows += static_cast<size_t>(p.w.rows());
    pool.run(total_rows, [&](size_t begin, size_t end, int) {
        size_t first_row = 0;  // of the current product, in the concatenated numbering
        for (const Product& p : products) {
            const size_t N = static_cast<size_t>(p.w.rows());
            size_t from = std::max(begin, first_row), to = std::min(end, first_row + N);
            if (from < to) {
                from -= first_row;
                to -= first_row;
                switch (p.w.dtype) {
                    case DType::F32: matmul_rows<DType::F32>(p.w, x, T, p.out, from, to); break;
                    case DType::BF16: matmul_rows<DType::BF16>(p.w, x, T, p.out, from, to); break;
                    case DType::F16: matmul_rows<DType::F16>(p.w, x, T, p.out, from, to); break;
                }
                if (p.bias && !p.bias->empty())
                    for (int t = 0; t < T; ++t)
                        for (size_t n = from; n < to; ++n) p.out[static_cast<size_t>(t) * N + n] += p.bias->at(static_cast<int64_t>(n));
            }
            first_row += N;
        }
    });
}

// out = x / sqrt(mean(x²) + eps) · gain. The mean is summed in double, as llama.cpp does.
inline void rms_norm(const float* x, const Tensor& gain, size_t width, double eps, float* out) {
    double sum_squares = 0;
    for (size_t i = 0; i < width; ++i) sum_squares += static_cast<double>(x[i]) * x[i];
    float scale = static_cast<float>(1.0 / std::sqrt(sum_squares / static_cast<double>(width) + eps));
    for (size_t i = 0; i < width; ++i) out[i] = x[i] * scale * gain.at(static_cast<int64_t>(i));
}

// The RoPE angle step of each frequency, with the configured long-context scaling applied.   [Dh/2]
inline std::vector<double> rope_inverse_frequencies(const Model& model) {
    const ModelConfig& c = model.config;
    const int half = c.head_dim / 2;
    std::vector<double> inverse(half);
    const RopeScaling& s = c.rope_scaling;
    for (int i = 0; i < half; ++i) {
        double freq = 1.0 / std::pow(c.rope_theta, 2.0 * i / c.head_dim);
        if (!model.rope_freq_divisors.empty()) {
            freq /= model.rope_freq_divisors[i];
        } else if (s.kind == RopeScaling::Kind::Linear) {
            freq /= s.factor;
        } else if (s.kind == RopeScaling::Kind::Llama3) {
            // Long wavelengths are stretched by `factor`, short ones kept, the band between blended smoothly.
            double wavelength = 2 * M_PI / freq;
            double low_wavelength = s.original_context / s.low_freq_factor;
            double high_wavelength = s.original_context / s.high_freq_factor;
            if (wavelength > low_wavelength) {
                freq /= s.factor;
            } else if (wavelength >= high_wavelength) {
                double smooth = (s.original_context / wavelength - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
                freq = (1 - smooth) * freq / s.factor + smooth * freq;
            }
        }
        inverse[i] = freq;
    }
    return inverse;
}

inline float silu(float x) { return x / (1.0f + std::exp(-x)); }

}  // namespace detail

// Runs batches through a model. Owns the scratch buffers, sized for the largest batch seen so far, so the steady
// state allocates nothing per token.
class ForwardPass {
public:
    ForwardPass(const Model& model, ThreadPool& pool)
        : model_(model), pool_(pool), inverse_frequencies_(detail::rope_inverse_frequencies(model)) {}

    const Model& model() const { return model_; }

    // Logits [rows, V] for the tokens whose wants_logits is set, in batch order.
    std::span<const float> forward(const Batch& batch, KVCache& cache) {
        const ModelConfig& c = model_.config;
        const int T = static_cast<int>(batch.size());
        if (T == 0) return {};
        if (batch.positions.size() != batch.tokens.size() || batch.sequences.size() != batch.tokens.size() ||
            batch.wants_logits.size() != batch.tokens.size())
            detail::fail("batch: tokens, positions, sequences and wants_logits differ in length");
        const size_t D = c.dim, Dh = c.head_dim, H = c.n_heads, Hkv = c.n_kv_heads, F = c.ffn_dim, V = c.vocab_size;
        const size_t q_width = H * Dh, kv_width = Hkv * Dh;
        resize(static_cast<size_t>(T));

        // Where each token's K/V go, and the cos/sin of its rotation (shared by all layers and heads).
        int longest = 0;
        for (int t = 0; t < T; ++t) {
            int token = batch.tokens[t], position = batch.positions[t];
            if (token < 0 || token >= c.vocab_size)
                detail::fail("token id ", token, " is outside the vocabulary (", c.vocab_size, " tokens)");
            if (position < 0 || position >= c.context_length)
                detail::fail("position ", position, " is outside the model's context of ", c.context_length, " tokens");
            const std::vector<int>& table = cache.block_table(batch.sequences[t]);
            if (static_cast<size_t>(position / cache.block_size()) >= table.size())
                detail::fail("KV cache: sequence ", batch.sequences[t], " has no block reserved for position ", position);
            slot_block_[t] = table[position / cache.block_size()];
            slot_offset_[t] = position % cache.block_size();
            longest = std::max(longest, position + 1);
            for (size_t i = 0; i < Dh / 2; ++i) {
                double angle = position * inverse_frequencies_[i];
                rope_cos_[t * (Dh / 2) + i] = static_cast<float>(std::cos(angle));
                rope_sin_[t * (Dh / 2) + i] = static_cast<float>(std::sin(angle));
            }
            model_.embedding.read_row(token, &x_[t * D]);
        }
        if (scores_.size() < static_cast<size_t>(pool_.size()) * longest) scores_.resize(static_cast<size_t>(pool_.size()) * longest);

        for (int l = 0; l < c.n_layers; ++l) {
            const LayerWeights& w = model_.layers[l];
            // Attention block.
            pool_.run(T, [&](size_t begin, size_t end, int) {
                for (size_t t = begin; t < end; ++t) detail::rms_norm(&x_[t * D], w.attn_norm, D, c.norm_eps, &xn_[t * D]);
            });
            detail::matmul(pool_, xn_.data(), T, {{w.wq, q_.data(), &w.bq}, {w.wk, k_.data(), &w.bk}, {w.wv, v_.data(), &w.bv}});
            pool_.run(T, [&](size_t begin, size_t end, int) {
                for (size_t t = begin; t < end; ++t) {
                    for (size_t h = 0; h < H; ++h) position_heads(&q_[t * q_width + h * Dh], w.q_norm, t);
                    for (size_t h = 0; h < Hkv; ++h) position_heads(&k_[t * kv_width + h * Dh], w.k_norm, t);
                    std::memcpy(cache.key(l, slot_block_[t], slot_offset_[t]), &k_[t * kv_width], kv_width * sizeof(float));
                    std::memcpy(cache.value(l, slot_block_[t], slot_offset_[t]), &v_[t * kv_width], kv_width * sizeof(float));
                }
            });
            pool_.run(static_cast<size_t>(T) * H, [&](size_t begin, size_t end, int thread) {
                for (size_t item = begin; item < end; ++item) attend(batch, cache, l, item / H, item % H, thread);
            });
            detail::matmul(pool_, attn_.data(), T, {{w.wo, xn_.data()}});
            for (size_t i = 0; i < T * D; ++i) x_[i] += xn_[i];

            // MLP block.
            pool_.run(T, [&](size_t begin, size_t end, int) {
                for (size_t t = begin; t < end; ++t) detail::rms_norm(&x_[t * D], w.ffn_norm, D, c.norm_eps, &xn_[t * D]);
            });
            detail::matmul(pool_, xn_.data(), T, {{w.w_gate, gate_.data()}, {w.w_up, up_.data()}});
            for (size_t i = 0; i < T * F; ++i) gate_[i] = detail::silu(gate_[i]) * up_[i];
            detail::matmul(pool_, gate_.data(), T, {{w.w_down, xn_.data()}});
            for (size_t i = 0; i < T * D; ++i) x_[i] += xn_[i];
        }

        // Final norm and the vocabulary projection, only for the rows someone will sample from.
        int rows = 0;
        for (int t = 0; t < T; ++t)
            if (batch.wants_logits[t]) detail::rms_norm(&x_[t * D], model_.final_norm, D, c.norm_eps, &xn_[rows++ * D]);
        if (logits_.size() < static_cast<size_t>(rows) * V) logits_.resize(static_cast<size_t>(rows) * V);
        if (rows > 0) detail::matmul(pool_, xn_.data(), rows, {{model_.lm_head, logits_.data()}});
        return {logits_.data(), static_cast<size_t>(rows) * V};
    }

private:
    void resize(size_t T) {
        const ModelConfig& c = model_.config;
        if (T <= capacity_) return;
        capacity_ = T;
        const size_t q_width = static_cast<size_t>(c.n_heads) * c.head_dim, kv_width = static_cast<size_t>(c.n_kv_heads) * c.head_dim;
        x_.resize(T * c.dim);                                              // [T, D] the residual stream
        xn_.resize(T * std::max<size_t>(c.dim, 1));                        // [T, D] normed input / block output
        q_.resize(T * q_width);                                            // [T, H, Dh]
        k_.resize(T * kv_width);                                           // [T, Hkv, Dh]
        v_.resize(T * kv_width);                                           // [T, Hkv, Dh]
        attn_.resize(T * q_width);                                         // [T, H, Dh]
        gate_.resize(T * c.ffn_dim);                                       // [T, F]
        up_.resize(T * c.ffn_dim);                                         // [T, F]
        rope_cos_.resize(T * c.head_dim / 2);                              // [T, Dh/2]
        rope_sin_.resize(T * c.head_dim / 2);                              // [T, Dh/2]
        slot_block_.resize(T);
        slot_offset_.resize(T);
    }

    // Per-head RMSNorm (qwen3), then the rotation by this token's position.
    void position_heads(float* head, const Tensor& norm, size_t t) {
        const ModelConfig& c = model_.config;
        const size_t Dh = c.head_dim, half = Dh / 2;
        if (!norm.empty()) detail::rms_norm(head, norm, Dh, c.norm_eps, head);
        const float* cos = &rope_cos_[t * half];
        const float* sin = &rope_sin_[t * half];
        for (size_t i = 0; i < half; ++i) {
            size_t a = c.rope_style == RopeStyle::HalfRotation ? i : 2 * i;
            size_t b = c.rope_style == RopeStyle::HalfRotation ? i + half : 2 * i + 1;
            float x0 = head[a], x1 = head[b];
            head[a] = x0 * cos[i] - x1 * sin[i];
            head[b] = x0 * sin[i] + x1 * cos[i];
        }
    }

    // One query head of one token over its sequence's cached keys and values.
    void attend(const Batch& batch, const KVCache& cache, int layer, size_t t, size_t h, int thread) {
        const ModelConfig& c = model_.config;
        const size_t Dh = c.head_dim, q_width = static_cast<size_t>(c.n_heads) * Dh;
        const size_t kv_head = h / static_cast<size_t>(c.n_heads / c.n_kv_heads);
        const int position = batch.positions[t];
        const int first = c.sliding_window > 0 ? std::max(0, position - c.sliding_window + 1) : 0;
        const std::vector<int>& table = cache.block_table(batch.sequences[t]);
        const int B = cache.block_size();
        const float* q = &q_[t * q_width + h * Dh];
        float* scores = &scores_[static_cast<size_t>(thread) * (scores_.size() / pool_.size())];
        const float scale = 1.0f / std::sqrt(static_cast<float>(Dh));

        float max_score = -std::numeric_limits<float>::infinity();
        for (int p = first; p <= position; ++p) {
            const float* key = cache.key(layer, table[p / B], p % B) + kv_head * Dh;
            float dot = 0;
            for (size_t i = 0; i < Dh; ++i) dot += q[i] * key[i];
            scores[p] = dot * scale;
            max_score = std::max(max_score, scores[p]);
        }
        float total = 0;
        for (int p = first; p <= position; ++p) {
            scores[p] = std::exp(scores[p] - max_score);
            total += scores[p];
        }
        float* out = &attn_[t * q_width + h * Dh];
        std::fill(out, out + Dh, 0.0f);
        for (int p = first; p <= position; ++p) {
            const float* value = cache.value(layer, table[p / B], p % B) + kv_head * Dh;
            float weight = scores[p] / total;
            for (size_t i = 0; i < Dh; ++i) out[i] += weight * value[i];
        }
    }

    const Model& model_;
    ThreadPool& pool_;
    std::vector<double> inverse_frequencies_;  // [Dh/2]
    size_t capacity_ = 0;
    std::vector<float> x_, xn_, q_, k_, v_, attn_, gate_, up_, rope_cos_, rope_sin_, scores_, logits_;
    std::vector<int> slot_block_, slot_offset_;
};

// =====================================================================================================================
// 6. SAMPLER — logits to one token id. Penalties first (they change the logits), then temperature: 0 is greedy
//    (argmax, ties to the lowest id); above 0 the logits are divided by it, then top-k, top-p and min-p trim the
//    candidates and a seeded generator draws from what is left. Cost: one pass over V, a sort only when top-p needs
//    one; microseconds next to the forward pass.  (chapter 04)
// =====================================================================================================================

struct SamplingParams {
    float temperature = 1.0f;         // 0: greedy
    int top_k = 0;                    // 0: off
    float top_p = 1.0f;               // 1: off
    float min_p = 0.0f;               // 0: off
    float repetition_penalty = 1.0f;  // 1: off; >1 discourages every token seen in the prompt or the output
    float presence_penalty = 0.0f;    // OpenAI's: subtracted once from every token already generated
    float frequency_penalty = 0.0f;   // OpenAI's: subtracted per occurrence in the generated text
    std::optional<uint64_t> seed;     // unset: a random seed (reported so the run can be repeated)
    int max_tokens = 256;
    bool ignore_eos = false;

    // Rejects values no sampler can honour, naming the parameter.
    void validate() const {
        auto bad = [](const char* name, double value, const char* rule) {
            detail::fail("invalid sampling parameter ", name, " = ", value, ": ", rule);
        };
        if (!(temperature >= 0) || !std::isfinite(temperature)) bad("temperature", temperature, "must be a finite number >= 0");
        if (top_k < 0) bad("top_k", top_k, "must be >= 0 (0 turns it off)");
        if (!(top_p > 0 && top_p <= 1)) bad("top_p", top_p, "must be in (0, 1]");
        if (!(min_p >= 0 && min_p <= 1)) bad("min_p", min_p, "must be in [0, 1]");
        if (!(repetition_penalty > 0) || !std::isfinite(repetition_penalty))
            bad("repetition_penalty", repetition_penalty, "must be a finite number > 0 (1 turns it off)");
        if (!(presence_penalty >= -2 && presence_penalty <= 2)) bad("presence_penalty", presence_penalty, "must be in [-2, 2]");
        if (!(frequency_penalty >= -2 && frequency_penalty <= 2)) bad("frequency_penalty", frequency_penalty, "must be in [-2, 2]");
        if (max_tokens < 0) bad("max_tokens", max_tokens, "must be >= 0");
    }
};

class Sampler {
public:
    Sampler(const SamplingParams& params, int vocab_size) : params_(params), counts_(static_cast<size_t>(vocab_size), 0) {
        params_.validate();
        seed_ = params.seed ? *params.seed : (static_cast<uint64_t>(std::random_device{}()) << 32 | std::random_device{}());
        // xoshiro256** seeded through splitmix64: the same seed gives the same stream on every platform, which
        // std::mt19937 + std::uniform_real_distribution does not promise.
        uint64_t state = seed_;
        for (auto& word : rng_) {
            state += 0x9E3779B97F4A7C15ull;
            uint64_t z = state;
            z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
            z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
            word = z ^ (z >> 31);
        }
    }

    uint64_t seed() const { return seed_; }

    // The prompt, for the repetition penalty; call once before sampling.
    void set_prompt(std::span<const int> prompt) {
        for (int id : prompt)
            if (id >= 0 && static_cast<size_t>(id) < counts_.size()) seen_in_prompt_.push_back(id);
    }
    // Each generated token, for the penalties.
    void accept(int id) {
        if (id >= 0 && static_cast<size_t>(id) < counts_.size()) {
            if (counts_[id]++ == 0) generated_.push_back(id);
        }
    }

    // Picks the next token. `logits` [V] is modified in place.
    int sample(std::span<float> logits) {
        apply_penalties(logits);
        const int V = static_cast<int>(logits.size());
        if (params_.temperature == 0) {
            int best = 0;
            for (int i = 1; i < V; ++i)
                if (logits[i] > logits[best]) best = i;
            return best;
        }
        candidates_.resize(static_cast<size_t>(V));
        for (int i = 0; i < V; ++i) candidates_[i] = {logits[i] / params_.temperature, i};
        auto higher = [](const Candidate& a, const Candidate& b) { return a.logit > b.logit || (a.logit == b.logit && a.id < b.id); };
        size_t kept = candidates_.size();
        if (params_.top_k > 0 && static_cast<size_t>(params_.top_k) < kept) {
            std::nth_element(candidates_.begin(), candidates_.begin() + params_.top_k, candidates_.end(), higher);
            kept = static_cast<size_t>(params_.top_k);
        }
        std::sort(candidates_.begin(), candidates_.begin() + static_cast<std::ptrdiff_t>(kept), higher);
        // Softmax over the survivors (the largest logit is first).
        double total = 0;
        for (size_t i = 0; i < kept; ++i) total += candidates_[i].probability = std::exp(candidates_[i].logit - candidates_[0].logit);
        if (params_.top_p < 1) {  // the smallest head of the distribution whose mass reaches top_p
            double mass = 0;
            size_t i = 0;
            while (i < kept && mass < params_.top_p * total) mass += candidates_[i++].probability;
            kept = std::max<size_t>(1, i);
        }
        if (params_.min_p > 0) {  // drop tokens less likely than min_p × the most likely one
            size_t i = 1;
            while (i < kept && candidates_[i].probability >= params_.min_p * candidates_[0].probability) ++i;
            kept = i;
        }
        total = 0;
        for (size_t i = 0; i < kept; ++i) total += candidates_[i].probability;
        double target = uniform() * total;
        for (size_t i = 0; i < kept; ++i) {
            target -= candidates_[i].probability;
            if (target < 0) return candidates_[i].id;
        }
        return candidates_[kept - 1].id;
    }

private:
    struct Candidate {
        float logit;
        int id;
        double probability = 0;
    };

    void apply_penalties(std::span<float> logits) {
        if (params_.repetition_penalty != 1.0f) {  // as Hugging Face and vLLM: shrink positive logits, grow negative
            auto penalize = [&](int id) {
                float& logit = logits[id];
                logit = logit > 0 ? logit / params_.repetition_penalty : logit * params_.repetition_penalty;
            };
            std::vector<char>& done = penalized_;
            done.assign(logits.size(), 0);
            for (int id : seen_in_prompt_)
                if (!done[id]++) penalize(id);
            for (int id : generated_)
                if (!done[id]++) penalize(id);
        }
        if (params_.presence_penalty != 0 || params_.frequency_penalty != 0)
            for (int id : generated_)
                logits[id] -= params_.presence_penalty + params_.frequency_penalty * static_cast<float>(counts_[id]);
    }

    double uniform() {  // [0, 1) from the top 53 bits of xoshiro256**
        auto rotl = [](uint64_t x, int k) { return (x << k) | (x >> (64 - k)); };
        uint64_t result = rotl(rng_[1] * 5, 7) * 9;
        uint64_t t = rng_[1] << 17;
        rng_[2] ^= rng_[0];
        rng_[3] ^= rng_[1];
        rng_[1] ^= rng_[2];
        rng_[0] ^= rng_[3];
        rng_[2] ^= t;
        rng_[3] = rotl(rng_[3], 45);
        return static_cast<double>(result >> 11) * 0x1.0p-53;
    }

    SamplingParams params_;
    uint64_t seed_ = 0;
    std::array<uint64_t, 4> rng_{};
    std::vector<int> counts_;          // [V] occurrences in the generated text
    std::vector<int> generated_;       // distinct generated ids
    std::vector<int> seen_in_prompt_;  // prompt ids
    std::vector<char> penalized_;      // [V] scratch
    std::vector<Candidate> candidates_;
};

// =====================================================================================================================
// 7. GENERATION — one request end to end: tokenize, prefill the prompt in one forward call, then decode one token per
//    step until EOS, max_tokens or the context runs out, streaming text as it completes. Every layer is timed, so a
//    user sees where the time went (chapter 01). The engine layer later runs many of these at once.
// =====================================================================================================================

struct GenerationResult {
    std::vector<int> prompt_ids;
    std::vector<int> generated_ids;
    std::string text;           // the generated text (without the prompt)
    std::string finish_reason;  // "stop" (EOS) or "length" (max_tokens or the context)
    uint64_t seed = 0;
    LayerTimes times;
};

inline Tokenizer tokenizer_for(const Model& model) {
    if (model.vocab.empty() && model.format == "llama2.c")
        detail::fail(model.source, ": no tokenizer to encode text with: give llama2.c's tokenizer file (--tokenizer FILE; "
                     "the default is tokenizer.bin beside the model), or pass token ids instead");
    if (model.vocab.empty())
        detail::fail(model.source, ": no SentencePiece vocabulary to tokenize text with (a Hugging Face folder's "
                     "tokenizer.json and GGUF byte-level vocabularies are read by the tokenizer layer, not yet here); "
                     "pass token ids instead");
    return Tokenizer(model.vocab, model.config.bos_id, model.source);
}

// Generates from prompt ids; on_text receives the text as it completes (may be empty to skip streaming).
inline GenerationResult generate_from_ids(const Model& model, ThreadPool& pool, std::vector<int> prompt_ids,
                                          const SamplingParams& params, const std::function<void(std::string_view)>& on_text = {}) {
    const ModelConfig& c = model.config;
    GenerationResult result;
    result.prompt_ids = std::move(prompt_ids);
    const int prompt_length = static_cast<int>(result.prompt_ids.size());
    if (prompt_length == 0) detail::fail("the prompt is empty: nothing to condition on (add BOS or some text)");
    if (prompt_length >= c.context_length)
        detail::fail("the prompt is ", prompt_length, " tokens, but the model's context holds ", c.context_length,
                     " (", model.source, "); shorten the prompt");
    Sampler sampler(params, c.vocab_size);
    result.seed = sampler.seed();
    sampler.set_prompt(result.prompt_ids);

    const int total = std::min(c.context_length, prompt_length + params.max_tokens);
    KVCache cache(c, (total + 15) / 16, 16);
    cache.reserve(0, total);
    ForwardPass forward(model, pool);
    std::optional<Tokenizer> tokenizer;
    std::optional<TextStream> stream;
    if (!model.vocab.empty()) {
        tokenizer.emplace(model.vocab, c.bos_id, model.source);
        stream.emplace(*tokenizer, result.prompt_ids.back());
    }

    Batch batch;
    for (int i = 0; i < prompt_length; ++i) batch.add(result.prompt_ids[i], i, 0, i == prompt_length - 1);
    std::vector<float> logits(static_cast<size_t>(c.vocab_size));
    result.finish_reason = "length";
    // Stops at max_tokens or when prompt + output fill the context (the model knows no later positions).
    for (int position = prompt_length; position < total; ++position) {
        Stopwatch clock;
        std::span<const float> row = forward.forward(batch, cache);
        (position == prompt_length ? result.times.prefill : result.times.decode) += clock.seconds();
        clock.restart();
        logits.assign(row.begin(), row.end());
        int next = sampler.sample(logits);
        result.times.sample += clock.seconds();
        if (!params.ignore_eos && std::find(c.eos_ids.begin(), c.eos_ids.end(), next) != c.eos_ids.end()) {
            result.finish_reason = "stop";
            break;
        }
        sampler.accept(next);
        result.generated_ids.push_back(next);
        if (stream) {
            clock.restart();
            std::string piece = stream->push(next);
            result.times.detokenize += clock.seconds();
            result.text += piece;
            if (on_text && !piece.empty()) on_text(piece);
        }
        batch.clear();
        batch.add(next, position, 0, true);
    }
    if (stream) {
        std::string rest = stream->finish();
        result.text += rest;
        if (on_text && !rest.empty()) on_text(rest);
    }
    return result;
}

// Generates from text: tokenizes with the model's vocabulary (BOS first when the vocabulary asks for it).
inline GenerationResult generate(const Model& model, ThreadPool& pool, std::string_view prompt, const SamplingParams& params,
                                 const std::function<void(std::string_view)>& on_text = {}) {
    Stopwatch clock;
    Tokenizer tokenizer = tokenizer_for(model);
    std::vector<int> ids = tokenizer.encode(prompt);
    double tokenize_seconds = clock.seconds();
    GenerationResult result = generate_from_ids(model, pool, std::move(ids), params, on_text);
    result.times.tokenize = tokenize_seconds;
    return result;
}

// =====================================================================================================================
// 8. MODEL FACTORY — models with random weights and a known shape: the built-in demo model (so the first command works
//    with nothing downloaded) and `infer make-model` (a Hugging Face folder of any size, for benchmarks). Their output
//    is meaningless; their cost per token is exactly that of a trained model of the same shape.
// =====================================================================================================================

struct ModelShape {
    int dim = 288, n_layers = 6, n_heads = 6, n_kv_heads = 6, ffn_dim = 768, vocab_size = 32000, context_length = 2048;
    bool tied_embeddings = false;  // the classifier is the embedding (llama2.c's stories models, SmolLM, Qwen2 0.5B)
};

// Hugging Face-named tensors with weights uniform in ±1/sqrt(fan-in) and unit norm gains, from a seeded generator.
inline std::vector<TensorData> random_weights(const ModelShape& shape, DType dtype, uint64_t seed) {
    if (shape.n_heads <= 0 || shape.dim % shape.n_heads != 0)
        detail::fail("model shape: dim ", shape.dim, " is not a multiple of heads ", shape.n_heads);
    const int64_t D = shape.dim, F = shape.ffn_dim, V = shape.vocab_size, Dh = shape.dim / shape.n_heads;
    const int64_t q_width = shape.n_heads * Dh, kv_width = shape.n_kv_heads * Dh;
    uint64_t state = seed * 0x9E3779B97F4A7C15ull + 1;
    auto next_uniform = [&state] {  // splitmix64 → [-1, 1)
        state += 0x9E3779B97F4A7C15ull;
        uint64_t z = state;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        return static_cast<float>(static_cast<double>(z >> 11) * 0x1.0p-52 - 1.0);
    };
    std::vector<TensorData> tensors;
    auto add = [&](std::string name, std::vector<int64_t> dims, bool is_gain) {
        TensorData t{std::move(name), dtype, dims, {}};
        int64_t count = std::accumulate(dims.begin(), dims.end(), int64_t{1}, std::multiplies<int64_t>());
        float range = is_gain ? 0 : 1.0f / std::sqrt(static_cast<float>(dims.back()));
        t.bytes.resize(static_cast<size_t>(count) * dtype_size(dtype));
        for (int64_t i = 0; i < count; ++i) {
            float value = is_gain ? 1.0f : next_uniform() * range;
            if (dtype == DType::F32) std::memcpy(&t.bytes[i * 4], &value, 4);
            else {
                uint16_t half = dtype == DType::BF16 ? f32_to_bf16(value) : f32_to_f16(value);
                std::memcpy(&t.bytes[i * 2], &half, 2);
            }
        }
        tensors.push_back(std::move(t));
    };
    add("model.embed_tokens.weight", {V, D}, false);
    for (int l = 0; l < shape.n_layers; ++l) {
        std::string p = "model.layers." + std::to_string(l) + ".";
        add(p + "input_layernorm.weight", {D}, true);
        add(p + "self_attn.q_proj.weight", {q_width, D}, false);
        add(p + "self_attn.k_proj.weight", {kv_width, D}, false);
        add(p + "self_attn.v_proj.weight", {kv_width, D}, false);
        add(p + "self_attn.o_proj.weight", {D, q_width}, false);
        add(p + "post_attention_layernorm.weight", {D}, true);
        add(p + "mlp.gate_proj.weight", {F, D}, false);
        add(p + "mlp.up_proj.weight", {F, D}, false);
        add(p + "mlp.down_proj.weight", {D, F}, false);
    }
    add("model.norm.weight", {D}, true);
    if (!shape.tied_embeddings) add("lm_head.weight", {V, D}, false);
    return tensors;
}

inline ModelConfig config_for_shape(const ModelShape& shape) {
    ModelConfig c;
    c.architecture = "llama";
    c.dim = shape.dim;
    c.n_layers = shape.n_layers;
    c.n_heads = shape.n_heads;
    c.n_kv_heads = shape.n_kv_heads;
    c.head_dim = shape.n_heads > 0 ? shape.dim / shape.n_heads : 0;
    c.ffn_dim = shape.ffn_dim;
    c.vocab_size = shape.vocab_size;
    c.context_length = shape.context_length;
    c.tied_embeddings = shape.tied_embeddings;
    c.bos_id = 1;
    c.eos_ids = {2};
    return c;
}

// Writes config.json + model.safetensors: a Hugging Face Llama folder that load_model reads back.
inline void save_random_model(const std::filesystem::path& folder, const ModelShape& shape, DType dtype, uint64_t seed) {
    ModelConfig c = config_for_shape(shape);
    detail::validate_config(c, folder.string());
    std::filesystem::create_directories(folder);
    std::ofstream config(folder / "config.json");
    if (!config) detail::fail((folder / "config.json").string(), ": cannot create");
    config << "{\n  \"architectures\": [\"LlamaForCausalLM\"],\n  \"model_type\": \"llama\",\n"
           << "  \"hidden_size\": " << c.dim << ",\n  \"intermediate_size\": " << c.ffn_dim << ",\n"
           << "  \"num_hidden_layers\": " << c.n_layers << ",\n  \"num_attention_heads\": " << c.n_heads << ",\n"
           << "  \"num_key_value_heads\": " << c.n_kv_heads << ",\n  \"vocab_size\": " << c.vocab_size << ",\n"
           << "  \"max_position_embeddings\": " << c.context_length << ",\n  \"rms_norm_eps\": 1e-05,\n"
           << "  \"rope_theta\": 10000.0,\n  \"hidden_act\": \"silu\",\n  \"tie_word_embeddings\": "
           << (c.tied_embeddings ? "true" : "false") << ",\n"
           << "  \"bos_token_id\": 1,\n  \"eos_token_id\": 2,\n  \"torch_dtype\": \""
           << (dtype == DType::F32 ? "float32" : dtype == DType::BF16 ? "bfloat16" : "float16") << "\"\n}\n";
    save_safetensors(folder / "model.safetensors", random_weights(shape, dtype, seed));
}

// The built-in demo: a small random Llama with a byte-level vocabulary (<unk>, <s>, </s>, the 256 bytes and "▁"), so
// any text tokenizes and every output decodes. It produces gibberish at the speed of a real model of its shape.
inline Model demo_model() {
    ModelShape shape{.dim = 128, .n_layers = 4, .n_heads = 4, .n_kv_heads = 2, .ffn_dim = 384, .vocab_size = 260, .context_length = 1024};
    Model model;
    model.source = "built-in demo model";
    model.format = "built-in";
    model.config = config_for_shape(shape);
    model.config.eos_ids.clear();  // random weights pick </s> by chance: let the demo run to max_tokens
    std::unordered_map<std::string, Tensor> tensors;
    for (TensorData& data : random_weights(shape, DType::F32, 2024)) {
        model.owned.push_back(std::move(data.bytes));
        tensors[data.name] = Tensor{data.name, data.dtype, data.shape, model.owned.back().data()};
    }
    detail::attach_hugging_face_tensors(model, tensors);
    Vocabulary& vocab = model.vocab;
    auto add = [&](std::string piece, Vocabulary::Type type) {
        vocab.pieces.push_back(std::move(piece));
        vocab.scores.push_back(0);
        vocab.types.push_back(type);
    };
    add("<unk>", Vocabulary::Type::Unknown);
    add("<s>", Vocabulary::Type::Control);
    add("</s>", Vocabulary::Type::Control);
    for (int byte = 0; byte < 256; ++byte) {
        char piece[8];
        std::snprintf(piece, sizeof piece, "<0x%02X>", byte);
        add(piece, Vocabulary::Type::Byte);
    }
    add("\xE2\x96\x81", Vocabulary::Type::Normal);
    return model;
}

}  // namespace infer
