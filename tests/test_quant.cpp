// Quantized GGUF: every block format decoded bit for bit as llama.cpp decodes it (the fixtures' dequant/ tensors), and
// whole models against llama.cpp's logits; bad quantized tensors refused by name.
#include "support.hpp"

#include "fuzz_seeds.hpp"

#include <cmath>
#include <random>

namespace {

const char* quantized_types[] = {"Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "Q4_K_M"};

using test::prefill_logits;

struct Difference {
    double max_abs = 0, rms = 0;
};

Difference difference(const std::vector<float>& a, const std::vector<float>& b) {
    REQUIRE(a.size() == b.size());
    Difference d;
    for (size_t i = 0; i < a.size(); ++i) {
        const double diff = std::fabs(double(a[i]) - double(b[i]));
        d.max_abs = std::max(d.max_abs, diff);
        d.rms += diff * diff;
    }
    d.rms = std::sqrt(d.rms / static_cast<double>(a.size()));
    return d;
}

// A copy of the tiny seed GGUF with the type id of its first tensor (token_embd.weight, rows of 8) replaced.
std::vector<uint8_t> gguf_with_embedding_type(uint32_t type) {
    std::vector<uint8_t> bytes = fuzz::tiny_gguf();
    const std::string name = "token_embd.weight";
    auto at = std::search(bytes.begin(), bytes.end(), name.begin(), name.end());
    REQUIRE(at != bytes.end());
    size_t position = static_cast<size_t>(at - bytes.begin()) + name.size();
    uint32_t n_dims;
    std::memcpy(&n_dims, &bytes[position], 4);
    position += 4 + 8 * n_dims;
    std::memcpy(&bytes[position], &type, 4);
    return bytes;
}

}  // namespace

TEST_CASE("every quantized tensor decodes bit for bit as llama.cpp decodes it") {
    REQUIRE_SHARED_OR_SKIP();
    for (const std::string type : quantized_types) {
        const auto folder = test::shared_dir() / "fixtures/quant" / type;
        if (!std::filesystem::exists(folder / "dequant")) continue;  // Q4_K_M: its Q4_K and Q6_K tensors are checked above
        infer::GgufFile gguf = infer::read_gguf(folder / ("model-" + type + ".gguf"));
        int checked = 0;
        for (const auto& entry : std::filesystem::directory_iterator(folder / "dequant")) {
            std::string name = entry.path().filename().string();
            name = name.substr(0, name.size() - 4);  // "blk.0.attn_q.weight.f32" → the tensor's name
            CAPTURE(type);
            CAPTURE(name);
            auto found = gguf.tensors.find(name);
            REQUIRE(found != gguf.tensors.end());
            const infer::Tensor& tensor = found->second;
            CHECK(infer::dtype_name(tensor.dtype) == type);
            std::vector<float> reference = test::read_floats(entry.path());
            std::vector<float> decoded(static_cast<size_t>(tensor.elements()));
            for (int64_t r = 0; r < tensor.rows(); ++r) tensor.read_row(r, decoded.data() + r * tensor.cols());
            REQUIRE(decoded.size() == reference.size());
            CHECK(std::memcmp(decoded.data(), reference.data(), decoded.size() * 4) == 0);
            ++checked;
        }
        MESSAGE(type << ": " << checked << " tensors bit-identical to llama.cpp's dequantization");
    }
}

TEST_CASE("quantized models match llama.cpp's logits: exactly on the decoded weights, within the fixtures' bounds on its quantized run") {
    REQUIRE_SHARED_OR_SKIP();
    for (const std::string type : quantized_types) {
        const auto folder = test::shared_dir() / "fixtures/quant" / type;
        infer::Model model = infer::load_model(folder / ("model-" + type + ".gguf"));
        infer::Json manifest = test::read_json(folder / "manifest.json");
        // Q4_0's and Q4_K's matrices run from the row groups made at load time (the other types from the mapping).
        CHECK((model.layers[0].w_down.row_groups != nullptr) == infer::detail::has_row_groups(model.layers[0].w_down.dtype));
        for (std::string sequence : {"A", "B"}) {
            CAPTURE(type);
            CAPTURE(sequence);
            std::vector<int> ids = test::ids_of(manifest.at("sequences").at(sequence).at("ids"));
            std::vector<float> ours = prefill_logits(model, ids);
            // A type decoded to f32 and computed in f32 has the fixture's f32 run on the decoded weights as its twin;
            // the integer kernels quantize the activations to 8 bits as llama.cpp does, and are held to its run.
            const bool integer = infer::detail::has_integer_kernel(model.layers[0].wq.dtype);
            Difference exact = difference(ours, test::read_floats(folder / ("logits_deqf32_" + sequence + ".f32")));
            if (!integer) CHECK(exact.max_abs < 1e-4);
            // llama.cpp's own run: held loosely, as the fixtures' README says (one rounding flip early on spreads).
            Difference loose = difference(ours, test::read_floats(folder / ("logits_" + sequence + ".f32")));
            CHECK(loose.max_abs <= 0.3);
            CHECK(loose.rms <= 0.05);
            if (sequence == "A")
                MESSAGE(type << std::string(integer ? " (integer kernels)" : " (decoded to f32)") << ": max |Δ| " << exact.max_abs
                             << " vs decoded-f32 run, " << loose.max_abs << " (RMS " << loose.rms << ") vs llama.cpp's quantized run");
        }
    }
}

TEST_CASE("quantized files: the programs accept them, and bad quantized tensors are refused by name") {
    REQUIRE_SHARED_OR_SKIP();
    const auto file = test::shared_dir() / "fixtures/quant/Q4_K_M/model-Q4_K_M.gguf";
    infer::Model model = infer::load_model(file);
    CHECK(model.layers[0].wq.dtype == infer::DType::Q4_K);
    CHECK(model.lm_head.dtype == infer::DType::Q6_K);  // a mixed file: each tensor carries its own type
    CHECK(model.embedding.bytes() == 512 / 256 * 144 * 256);

    test::TempDir dir("quant");
    auto write = [&](const std::string& name, const std::vector<uint8_t>& bytes) {
        test::write_file(dir / name, std::string(bytes.begin(), bytes.end()));
        return (dir / name).string();
    };
    // Rows of 8 weights cannot hold 32-weight Q8_0 blocks.
    std::string error = test::error_of([&] { infer::load_model(write("rows.gguf", gguf_with_embedding_type(8))); });
    CHECK(error.find("tensor token_embd.weight of type Q8_0 has rows of 8 weights, not a multiple of its block of 32") !=
          std::string::npos);
    // A type infer does not decode, and a type id no one knows.
    error = test::error_of([&] { infer::load_model(write("iq.gguf", gguf_with_embedding_type(16))); });
    CHECK(error.find("tensor token_embd.weight has type IQ2_XXS, which is not supported (supported: F32, F16, BF16, Q8_0") !=
          std::string::npos);
    error = test::error_of([&] { infer::load_model(write("unknown.gguf", gguf_with_embedding_type(99))); });
    CHECK(error.find("tensor token_embd.weight has type unknown (99)") != std::string::npos);
    // A file cut inside its quantized blocks.
    std::string whole = infer::read_text_file(file);
    test::write_file(dir / "cut.gguf", whole.substr(0, whole.size() - 1000));
    error = test::error_of([&] { infer::load_model(dir / "cut.gguf"); });
    CHECK(error.find("cut.gguf: tensor ") != std::string::npos);
}

TEST_CASE("infer generate, logits and tokenize run a quantized GGUF") {
    REQUIRE_SHARED_OR_SKIP();
    const std::string file = (test::shared_dir() / "fixtures/quant/Q4_K_M/model-Q4_K_M.gguf").string();
    test::ProgramRun generated = test::run_infer({"generate", "-m", file, "--prompt-ids", "1,5,9", "--ids", "--temp", "0", "-n", "4"});
    CHECK(generated.exit_code == 0);
    CHECK(generated.out.find("\"generated_ids\":[") != std::string::npos);
    test::TempDir dir("quant-cli");
    test::ProgramRun logits = test::run_infer({"logits", "-m", file, "--tokens", "1,5,9", "--out", (dir / "l.f32").string()});
    CHECK(logits.exit_code == 0);
    CHECK(test::read_floats(dir / "l.f32").size() == 3 * 512);
    // infer quantize takes a Hugging Face folder too, and says what the file could not keep.
    const std::string folder = (test::shared_dir() / "fixtures/arch/qwen2").string(), out = (dir / "qwen2.gguf").string();
    test::ProgramRun quantized = test::run_infer({"quantize", "-m", folder, "-o", out, "--type", "Q8_0"});
    CHECK(quantized.exit_code == 0);
    CHECK(quantized.err.find("note: " + folder + ": no tokenizer.json") != std::string::npos);
    CHECK(quantized.err.find("wrote " + out) != std::string::npos);
    CHECK(infer::load_model(out).layers[0].wq.dtype == infer::DType::Q8_0);
    test::ProgramRun missing = test::run_infer({"quantize", "-m", (dir / "absent").string(), "-o", out, "--type", "Q8_0"});
    CHECK(missing.exit_code != 0);
    CHECK(missing.err.find("absent: no such file or folder") != std::string::npos);
}

// The formats without a fixture, checked against a second reading of their layout: each weight located on its own
// (as llama.cpp's quantizers pack them) instead of the decoders' loops, over random blocks.
TEST_CASE("Q5_0, Q5_1, Q2_K and Q3_K decode every weight where their layout puts it") {
    std::mt19937 rng(7);
    auto random_block = [&](int bytes) {
        std::vector<std::byte> block(static_cast<size_t>(bytes));
        for (std::byte& b : block) b = static_cast<std::byte>(rng() & 0xFF);
        return block;
    };
    auto set_f16 = [](std::vector<std::byte>& block, size_t at, float value) {
        uint16_t half = infer::f32_to_f16(value);
        std::memcpy(&block[at], &half, 2);
    };
    auto u8 = [](const std::vector<std::byte>& block, size_t at) { return static_cast<int>(static_cast<uint8_t>(block[at])); };
    for (int trial = 0; trial < 50; ++trial) {
        for (bool with_min : {false, true}) {  // Q5_0 / Q5_1: the fifth bit of element e is bit e of qh
            std::vector<std::byte> block = random_block(with_min ? 24 : 22);
            set_f16(block, 0, 0.01f * static_cast<float>(trial + 1));
            if (with_min) set_f16(block, 2, -0.03f);
            const size_t qh_at = with_min ? 4 : 2, qs_at = with_min ? 8 : 6;
            uint32_t qh;
            std::memcpy(&qh, &block[qh_at], 4);
            std::vector<float> y(32);
            infer::dequantize_row(with_min ? infer::DType::Q5_1 : infer::DType::Q5_0, block.data(), y.data(), 32);
            const float d = infer::f16_to_f32(infer::f32_to_f16(0.01f * static_cast<float>(trial + 1)));
            const float m = infer::f16_to_f32(infer::f32_to_f16(-0.03f));
            for (int e = 0; e < 32; ++e) {
                const int nibble = e < 16 ? u8(block, qs_at + e) & 15 : u8(block, qs_at + e - 16) >> 4;
                const int q = nibble | static_cast<int>(((qh >> e) & 1) << 4);
                CHECK(y[static_cast<size_t>(e)] == (with_min ? d * static_cast<float>(q) + m : d * static_cast<float>(q - 16)));
            }
        }
        {  // Q2_K: scales[16] (scale low nibble, min high nibble), qs[64], d, dmin
            std::vector<std::byte> block = random_block(84);
            set_f16(block, 80, 0.02f);
            set_f16(block, 82, 0.005f);
            std::vector<float> y(256);
            infer::dequantize_row(infer::DType::Q2_K, block.data(), y.data(), 256);
            const float d = infer::f16_to_f32(infer::f32_to_f16(0.02f)), dmin = infer::f16_to_f32(infer::f32_to_f16(0.005f));
            for (int e = 0; e < 256; ++e) {
                const int h = e / 128, r = e % 128, pass = r / 32, l = r % 32;
                const int q = (u8(block, 16 + 32 * h + l) >> (2 * pass)) & 3;
                const int packed = u8(block, static_cast<size_t>(e / 16));
                CHECK(y[static_cast<size_t>(e)] == d * static_cast<float>(packed & 15) * static_cast<float>(q) -
                                                       dmin * static_cast<float>(packed >> 4));
            }
        }
        {  // Q3_K: hmask[32] (bit e/32 of hmask[e % 32]), qs[64], 12 bytes of 6-bit scales, d
            std::vector<std::byte> block = random_block(110);
            set_f16(block, 108, 0.04f);
            std::vector<float> y(256);
            infer::dequantize_row(infer::DType::Q3_K, block.data(), y.data(), 256);
            const float d = infer::f16_to_f32(infer::f32_to_f16(0.04f));
            for (int e = 0; e < 256; ++e) {
                const int h = e / 128, r = e % 128, pass = r / 32, l = r % 32, sub = e / 16;
                const int low2 = (u8(block, 32 + 32 * h + l) >> (2 * pass)) & 3;
                const int high = (u8(block, static_cast<size_t>(e % 32)) >> (e / 32)) & 1;
                const int scale_low = sub < 8 ? u8(block, 96 + sub) & 15 : u8(block, 96 + sub - 8) >> 4;
                const int scale_high = (u8(block, 96 + 8 + sub % 4) >> (2 * (sub / 4))) & 3;
                const int scale = (scale_low | scale_high << 4) - 32;
                CHECK(y[static_cast<size_t>(e)] == d * static_cast<float>(scale) * static_cast<float>(low2 - (high ? 0 : 4)));
            }
        }
    }
}

// ---- infer quantize ------------------------------------------------------------------------------------------------

namespace {

std::filesystem::path quant_fixture(const std::string& type) {
    return test::shared_dir() / "fixtures/quant" / type / ("model-" + type + ".gguf");
}

infer::GgufFile quantized_copy(const test::TempDir& dir, const std::string& type, bool pure) {
    infer::QuantizeOptions options;
    options.type = type;
    options.pure = pure;
    const std::filesystem::path out = dir / (type + (pure ? "-pure" : "") + ".gguf");
    infer::quantize_gguf(quant_fixture("F32"), out, options);
    return infer::read_gguf(out);
}

}  // namespace

TEST_CASE("quantize: Q8_0, Q4_0, Q4_1 are byte-identical to llama-quantize's files of the same F32 model") {
    REQUIRE_SHARED_OR_SKIP();
    test::TempDir dir("quantize-exact");
    for (const std::string type : {"Q8_0", "Q4_0", "Q4_1"}) {
        CAPTURE(type);
        const infer::GgufFile ours = quantized_copy(dir, type, true);
        const infer::GgufFile theirs = infer::read_gguf(quant_fixture(type));
        REQUIRE(ours.tensors.size() == theirs.tensors.size());
        for (const auto& entry : theirs.tensors) {
            const std::string& name = entry.first;
            const infer::Tensor& reference = entry.second;
            CAPTURE(name);
            REQUIRE(ours.tensors.count(name) == 1);
            const infer::Tensor& t = ours.tensors.at(name);
            CHECK(t.dtype == reference.dtype);
            CHECK(t.shape == reference.shape);
            REQUIRE(t.bytes() == reference.bytes());
            CHECK(std::memcmp(t.data, reference.data, t.bytes()) == 0);
        }
        // The metadata is carried over (file type and quantization version aside), with the types it was read with.
        for (const auto& entry : theirs.metadata) {
            const std::string& key = entry.first;
            const auto& value = entry.second;
            CAPTURE(key);
            REQUIRE(ours.metadata.count(key) == 1);
            CHECK(ours.metadata.at(key).value == value.value);
            CHECK(ours.metadata.at(key).type == value.type);
        }
    }
}

namespace {

// Every tensor of `theirs` is in `ours` with the same type, shape and bytes (`tolerance` > 0: the same values within it
// relative, for tensors computed in floating point such as rope_freqs), and `ours` holds no other.
void check_same_tensors(const infer::GgufFile& ours, const infer::GgufFile& theirs, double tolerance = 0) {
    CHECK(ours.tensors.size() == theirs.tensors.size());
    for (const auto& [name, reference] : theirs.tensors) {
        CAPTURE(name);
        REQUIRE(ours.tensors.count(name) == 1);
        const infer::Tensor& t = ours.tensors.at(name);
        CHECK(infer::dtype_name(t.dtype) == std::string(infer::dtype_name(reference.dtype)));
        CHECK(t.shape == reference.shape);
        REQUIRE(t.bytes() == reference.bytes());
        if (tolerance > 0 && name == "rope_freqs.weight") {
            for (int64_t i = 0; i < t.elements(); ++i) CHECK(std::fabs(t.at(i) - reference.at(i)) <= tolerance * std::fabs(reference.at(i)));
        } else {
            CHECK(std::memcmp(t.data, reference.data, t.bytes()) == 0);
        }
    }
}

}  // namespace

TEST_CASE("quantize from a Hugging Face folder: Q8_0, Q4_0, Q4_1 of its safetensors are byte-identical to llama-quantize's files") {
    REQUIRE_SHARED_OR_SKIP();
    test::TempDir dir("quantize-folder");
    const auto folder = test::shared_dir() / "fixtures/quant/F32";  // config.json and model.safetensors beside the GGUF
    for (const std::string type : {"Q8_0", "Q4_0", "Q4_1"}) {
        CAPTURE(type);
        infer::QuantizeOptions options;
        options.type = type;
        options.pure = true;
        const infer::QuantizeReport report = infer::quantize_model(folder, dir / (type + ".gguf"), options);
        REQUIRE(report.notes.size() == 1);  // the fixture has no tokenizer.json
        CHECK(report.notes[0].find("no tokenizer.json") != std::string::npos);
        // Same bytes for every tensor: the names, the order of a Llama's q and k rows, the blocks.
        check_same_tensors(infer::read_gguf(dir / (type + ".gguf")), infer::read_gguf(quant_fixture(type)));
    }
}

TEST_CASE("quantize from a Hugging Face folder: every architecture fixture is llama.cpp's converted file, tensor for tensor, and runs to its logits") {
    REQUIRE_SHARED_OR_SKIP();
    test::TempDir dir("convert-folder");
    for (const std::string family : {"llama", "llama3", "mistral", "qwen2", "qwen3", "smollm"}) {
        CAPTURE(family);
        const auto folder = test::shared_dir() / "fixtures/arch" / family;
        infer::QuantizeOptions options;
        options.type = "F32";
        const auto out = dir / (family + ".gguf");
        infer::quantize_model(folder, out, options);
        const infer::GgufFile ours = infer::read_gguf(out), theirs = infer::read_gguf(folder / "model.gguf");
        check_same_tensors(ours, theirs, 1e-6);
        // The hyperparameters llama.cpp reads, under the same keys and values.
        const std::string arch = theirs.string_or("general.architecture", "");
        CHECK(ours.string_or("general.architecture", "") == arch);
        for (const char* key : {"block_count", "context_length", "embedding_length", "feed_forward_length", "attention.head_count",
                                "attention.head_count_kv", "rope.freq_base", "attention.layer_norm_rms_epsilon"}) {
            CAPTURE(key);
            REQUIRE(theirs.find(arch + "." + key));
            REQUIRE(ours.find(arch + "." + key));
            CHECK(ours.number_or(arch + "." + key, -1) == doctest::Approx(theirs.number_or(arch + "." + key, -2)).epsilon(1e-7));
        }
        // And it runs: the folder's reference logits from the converted file.
        const infer::Model model = infer::load_model(out);
        const infer::Json manifest = test::read_json(folder / "manifest.json");
        for (std::string name : {"A", "B"}) {
            CAPTURE(name);
            const std::vector<int> ids = test::ids_of(manifest.at("sequences").at(name).at("ids"));
            CHECK(difference(prefill_logits(model, ids), test::read_floats(folder / ("logits_" + name + ".f32"))).max_abs < 1e-4);
        }
    }
}

TEST_CASE("quantize from a folder with a tokenizer.json: the GGUF carries its vocabulary and encodes text as the folder does") {
    REQUIRE_SHARED_OR_SKIP();
    test::TempDir dir("convert-tokenizer");
    // A SentencePiece-style and a byte-level tokenizer, each beside random weights of a matching vocabulary (Qwen3's
    // padded past its last token, as real checkpoints are).
    for (const std::string family : {"llama2", "qwen3"}) {
        CAPTURE(family);
        const auto tokenizers = test::shared_dir() / "tokenizers" / family;
        infer::ModelShape shape;
        shape.dim = 32;
        shape.n_layers = 1;
        shape.n_heads = shape.n_kv_heads = 2;
        shape.ffn_dim = 64;
        shape.context_length = 256;
        shape.vocab_size = family == "llama2" ? 32000 : 151680;
        const auto folder = dir / family;
        infer::save_random_model(folder, shape, infer::DType::F32, 3);
        for (const char* file : {"tokenizer.json", "tokenizer_config.json"})
            std::filesystem::copy_file(tokenizers / file, folder / file);
        infer::QuantizeOptions options;
        options.type = "Q8_0";
        const auto out = dir / (family + ".gguf");
        const infer::QuantizeReport report = infer::quantize_model(folder, out, options);
        CHECK(report.notes.size() == (family == "qwen3" ? 1u : 0u));  // Qwen's NFC normalizer is not stored
        const infer::Model model = infer::load_model(out);
        REQUIRE(static_cast<int>(model.vocab.pieces.size()) == shape.vocab_size);
        CHECK(model.vocab.types.back() == (family == "qwen3" ? infer::Vocabulary::Type::Unused : infer::Vocabulary::Type::Normal));
        const infer::Tokenizer converted = infer::tokenizer_for(model);
        const infer::Tokenizer reference = infer::load_tokenizer(tokenizers);
        // BOS: the tokenizer's; Qwen's has none, and the file takes config.json's id, as llama.cpp's converter does (never
        // added to a prompt: add_bos_token is false).
        if (family == "llama2") CHECK(converted.bos_token() == reference.bos_token());
        CHECK(converted.chat_template() == reference.chat_template());
        for (const std::string text : {"Hello, world!", "  two spaces, a tab\tand a newline\n", "числа 12345 and ÿ", "<s>x</s>",
                                        "<|im_start|>user\nhi<|im_end|>"}) {
            CAPTURE(text);
            CHECK(converted.encode(text, true) == reference.encode(text, true));
        }
    }
}

TEST_CASE("quantize: the K-quants' own search leaves at most 10% more error than llama-quantize's, tensor by tensor") {
    REQUIRE_SHARED_OR_SKIP();
    test::TempDir dir("quantize-k");
    const infer::GgufFile source = infer::read_gguf(quant_fixture("F32"));
    for (const std::string type : {"Q4_K", "Q5_K", "Q6_K"}) {
        CAPTURE(type);
        const infer::GgufFile ours = quantized_copy(dir, type, true);
        const infer::Json manifest = infer::Json::parse(infer::read_text_file(test::shared_dir() / "fixtures/quant" / type / "manifest.json"));
        double ratio_sum = 0;
        int quantized = 0;
        for (const infer::Json& entry : manifest.at("tensors").as_array()) {
            const std::string name = entry.at("name").as_string();
            if (entry.at("type").as_string() == "F32") continue;
            CAPTURE(name);
            const infer::Tensor& t = ours.tensors.at(name);
            REQUIRE(infer::dtype_name(t.dtype) == entry.at("type").as_string());
            const infer::Tensor& f32 = source.tensors.at(name);
            std::vector<float> row(static_cast<size_t>(t.cols())), exact(row.size());
            double squares = 0;
            for (int64_t r = 0; r < t.rows(); ++r) {
                t.read_row(r, row.data());
                f32.read_row(r, exact.data());
                for (size_t i = 0; i < row.size(); ++i) squares += double(row[i] - exact[i]) * double(row[i] - exact[i]);
            }
            const double rms = std::sqrt(squares / static_cast<double>(t.elements()));
            const double theirs = entry.at("quantization_error_vs_f32_source").at("rms").as_number();
            CHECK(rms <= 1.10 * theirs);
            ratio_sum += rms / theirs;
            ++quantized;
        }
        MESSAGE(type << ": RMS error " << ratio_sum / quantized << "x llama-quantize's on average over " << quantized << " tensors");
    }
}

TEST_CASE("quantize: Q5_0, Q5_1, Q2_K and Q3_K files, round-tripped through the dequantizer") {
    REQUIRE_SHARED_OR_SKIP();
    test::TempDir dir("quantize-round-trip");
    const infer::GgufFile source = infer::read_gguf(quant_fixture("F32"));
    const infer::Model f32 = infer::load_model(quant_fixture("F32"));
    const std::vector<int> ids = {1, 17, 99, 204, 311, 42, 7, 480};
    const std::vector<float> exact_logits = prefill_logits(f32, ids);
    // Error bounds relative to each tensor's RMS, from the grids' spacing: uniform rounding leaves step/√12, and a
    // block of 32 (or a sub-block of 16) Gaussian weights spans about 4.5 (or 3.5) standard deviations: for 5 bits
    // about 0.04, for 3 bits 0.14, for 2 bits 0.33, before the scales' own rounding. The bounds leave room for that.
    const std::vector<std::pair<std::string, double>> types = {{"Q5_0", 0.06}, {"Q5_1", 0.06}, {"Q3_K", 0.22}, {"Q2_K", 0.45}};
    std::vector<double> mean_errors, logit_errors;
    for (const auto& type_and_bound : types) {
        const std::string& type = type_and_bound.first;  // named apart: clang refuses bindings in CAPTURE's lambda
        const double bound = type_and_bound.second;
        CAPTURE(type);
        const infer::GgufFile ours = quantized_copy(dir, type, true);
        const infer::DType dtype = type == "Q5_0" ? infer::DType::Q5_0 : type == "Q5_1" ? infer::DType::Q5_1
                                 : type == "Q3_K" ? infer::DType::Q3_K : infer::DType::Q2_K;
        double error_sum = 0;
        int matrices = 0;
        for (const auto& entry : ours.tensors) {
            const std::string& name = entry.first;
            const infer::Tensor& t = entry.second;
            if (t.shape.size() < 2) continue;
            CAPTURE(name);
            REQUIRE(t.dtype == dtype);
            const infer::Tensor& original = source.tensors.at(name);
            std::vector<float> row(static_cast<size_t>(t.cols())), x(row.size()), again(row.size());
            std::vector<std::byte> blocks(static_cast<size_t>(t.bytes() / t.rows()));
            double squares = 0, signal = 0;
            bool fixed_point = true;
            for (int64_t r = 0; r < t.rows(); ++r) {
                t.read_row(r, row.data());
                original.read_row(r, x.data());
                for (size_t i = 0; i < row.size(); ++i) {
                    squares += double(row[i] - x[i]) * double(row[i] - x[i]);
                    signal += double(x[i]) * double(x[i]);
                }
                // Q5_0 and Q5_1 place their grid by the block's extremes: weights already on a grid quantize to it.
                if (dtype == infer::DType::Q5_0 || dtype == infer::DType::Q5_1) {
                    infer::quantize_row(dtype, row.data(), blocks.data(), t.cols());
                    infer::dequantize_row(dtype, blocks.data(), again.data(), t.cols());
                    fixed_point = fixed_point && again == row;
                }
            }
            CHECK(fixed_point);
            const double relative = std::sqrt(squares / signal);
            CHECK(relative < bound);
            error_sum += relative;
            ++matrices;
        }
        REQUIRE(matrices > 0);
        mean_errors.push_back(error_sum / matrices);
        // The file loads and runs; fewer bits, further from the F32 model's logits.
        const infer::Model model = infer::load_model(dir / (type + "-pure.gguf"));
        logit_errors.push_back(difference(prefill_logits(model, ids), exact_logits).rms);
        MESSAGE(type << ": weight error " << mean_errors.back() << " of the weights' RMS on average over " << matrices
                     << " matrices; logit RMS vs F32 " << logit_errors.back());
    }
    CHECK(mean_errors[2] > mean_errors[0]);  // Q3_K has fewer bits than Q5_0
    CHECK(mean_errors[3] > mean_errors[2]);  // Q2_K fewer still
    CHECK(logit_errors[3] > logit_errors[0]);
}

TEST_CASE("quantize: Q4_K_M gives the same tensors more bits as llama-quantize, and the file runs") {
    REQUIRE_SHARED_OR_SKIP();
    test::TempDir dir("quantize-mix");
    const infer::GgufFile ours = quantized_copy(dir, "Q4_K_M", false);
    const infer::GgufFile theirs = infer::read_gguf(quant_fixture("Q4_K_M"));
    for (const auto& entry : theirs.tensors) {
        const std::string& name = entry.first;
        CAPTURE(name);
        CHECK(ours.tensors.at(name).dtype == entry.second.dtype);
    }
    CHECK(ours.integer("general.file_type") == 15);
    // Its logits stay as close to the F32 model's as llama.cpp's own Q4_K_M file does (positions of sequence A).
    const infer::Model f32 = infer::load_model(quant_fixture("F32"));
    const infer::Model mine = infer::load_model(dir / "Q4_K_M.gguf");
    const infer::Model llama = infer::load_model(quant_fixture("Q4_K_M"));
    const std::vector<int> ids = {1, 17, 99, 204, 311, 42, 7, 480};
    const std::vector<float> exact = prefill_logits(f32, ids), ours_logits = prefill_logits(mine, ids),
                             their_logits = prefill_logits(llama, ids);
    const Difference ours_error = difference(ours_logits, exact), their_error = difference(their_logits, exact);
    MESSAGE("logit RMS vs F32: ours " << ours_error.rms << ", llama-quantize's " << their_error.rms);
    CHECK(ours_error.rms <= 1.10 * their_error.rms);
}

TEST_CASE("quantize: unknown types, quantized inputs and non-finite weights are refused, leaving no file") {
    REQUIRE_SHARED_OR_SKIP();
    test::TempDir dir("quantize-bad");
    infer::QuantizeOptions options;
    options.type = "Q3_K_XL";
    std::string message = test::error_of([&] { infer::quantize_gguf(quant_fixture("F32"), dir / "a.gguf", options); });
    CHECK(message.find("Q3_K_XL") != std::string::npos);
    CHECK(message.find("Q4_K_M") != std::string::npos);  // the list of supported ones
    options.type = "Q8_0";
    message = test::error_of([&] { infer::quantize_gguf(quant_fixture("Q4_0"), dir / "b.gguf", options); });
    CHECK(message.find("already Q4_0") != std::string::npos);
    CHECK_FALSE(std::filesystem::exists(dir / "b.gguf"));

    // A NaN in the middle of a matrix: named by tensor and row; neither the output nor its .part remains.
    std::string bytes = infer::read_text_file(quant_fixture("F32"));
    const infer::GgufFile source = infer::read_gguf(quant_fixture("F32"));
    const infer::Tensor& wq = source.tensors.at("blk.0.attn_q.weight");
    const size_t at = static_cast<size_t>(wq.data - source.file->data()) + 5 * 256 * 4 + 3 * 4;
    const float nan = std::numeric_limits<float>::quiet_NaN();
    std::memcpy(&bytes[at], &nan, 4);
    test::write_file(dir / "nan.gguf", bytes);
    message = test::error_of([&] { infer::quantize_gguf(dir / "nan.gguf", dir / "c.gguf", options); });
    CHECK(message.find("blk.0.attn_q.weight row 5") != std::string::npos);
    CHECK_FALSE(std::filesystem::exists(dir / "c.gguf"));
    CHECK_FALSE(std::filesystem::exists(dir / "c.gguf.part"));
}

// ---- integer kernels -----------------------------------------------------------------------------------------------

TEST_CASE("integer kernels: activations quantize to llama.cpp's Q8_0, Q8_1 and Q8_K blocks bit for bit") {
    REQUIRE_SHARED_OR_SKIP();
    const auto folder = test::shared_dir() / "fixtures/quant/actq";
    const std::vector<float> x = test::read_floats(folder / "x.f32");  // 8 rows of 512, edge cases included
    const std::string q8_0 = infer::read_text_file(folder / "q8_0.bin"), q8_k = infer::read_text_file(folder / "q8_k.bin");
    infer::detail::QuantizedRows by_32, by_256;
    infer::detail::quantize_activations(x.data(), 8, 512, 32, by_32);
    infer::detail::quantize_activations(x.data(), 8, 512, 256, by_256);
    REQUIRE(q8_0.size() == 8 * 16 * 34);
    for (size_t b = 0; b < 8 * 16; ++b) {
        CAPTURE(b);
        const std::byte* block = reinterpret_cast<const std::byte*>(q8_0.data() + b * 34);
        CHECK(by_32.d[b] == infer::detail::f16_at(block));
        CHECK(std::memcmp(&by_32.q[b * 32], block + 2, 32) == 0);
    }
    const std::string q8_1 = infer::read_text_file(folder / "q8_1.bin");
    REQUIRE(q8_1.size() == 8 * 16 * 36);
    for (size_t b = 0; b < 8 * 16; ++b) {  // Q8_1: d, then s = d·Σq (f16), then the same q as Q8_0
        CAPTURE(b);
        const std::byte* block = reinterpret_cast<const std::byte*>(q8_1.data() + b * 36);
        CHECK(by_32.d[b] == infer::detail::f16_at(block));
        CHECK(by_32.s[b] == infer::detail::f16_at(block + 2));
        CHECK(std::memcmp(&by_32.q[b * 32], block + 4, 32) == 0);
    }
    REQUIRE(q8_k.size() == 8 * 2 * 292);
    for (size_t b = 0; b < 8 * 2; ++b) {
        CAPTURE(b);
        const char* block = q8_k.data() + b * 292;
        float d;
        std::memcpy(&d, block, 4);
        CHECK(by_256.d[b] == d);
        CHECK(std::memcmp(&by_256.q[b * 256], block + 4, 256) == 0);
        CHECK(std::memcmp(&by_256.sums[b * 16], block + 260, 32) == 0);
    }
}

TEST_CASE("integer kernels: every block type gives the same bits on every kernel path, for any batch") {
    // Random weights quantized to each type, against 1 to 9 tokens: each path's product equals the portable one's bit
    // for bit, and each token's row is the same bits whatever its batch-mates (tiles of 4 and the remainders).
    std::mt19937 rng(5);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    const int64_t N = 13, K = 512;
    std::vector<float> x(9 * K);
    for (float& v : x) v = normal(rng);
    const infer::CpuKernels chosen = infer::cpu_kernels();
    infer::ThreadPool pool(2);
    using D = infer::DType;
    for (D dtype : {D::Q8_0, D::Q4_0, D::Q4_1, D::Q5_0, D::Q5_1, D::Q2_K, D::Q3_K, D::Q4_K, D::Q5_K, D::Q6_K}) {
        const std::string name = infer::dtype_block(dtype).name;
        CAPTURE(name);
        std::vector<float> weights(N * K);
        for (float& v : weights) v = normal(rng) * 0.1f;
        std::vector<std::byte> blocks(infer::dtype_bytes(dtype, N * K));
        infer::quantize_row(dtype, weights.data(), blocks.data(), N * K);
        const infer::Tensor w{name, dtype, {N, K}, blocks.data()};
        REQUIRE(infer::detail::has_integer_kernel(dtype));
        std::vector<float> portable;
        for (infer::CpuKernels path : {infer::CpuKernels::Portable, infer::CpuKernels::Avx2, infer::CpuKernels::Avx512}) {
            if (!infer::cpu_supports(path)) continue;
            CAPTURE(infer::cpu_kernels_name(path));
            infer::use_cpu_kernels(path);
            std::vector<float> all(9 * N);
            infer::detail::matmul(pool, x.data(), 9, {{w, all.data()}});
            if (portable.empty()) portable = all;
            CHECK(all == portable);
            for (int T : {1, 2, 3, 5}) {
                std::vector<float> part(static_cast<size_t>(T) * N);
                infer::detail::matmul(pool, x.data() + 2 * K, T, {{w, part.data()}});
                CHECK(std::equal(part.begin(), part.end(), all.begin() + 2 * N));
            }
            if (infer::detail::has_row_groups(dtype)) {  // the row groups a loaded model keeps: the file layout's bits
                const size_t block_count = K / infer::dtype_block(dtype).elements, groups = (N + 15) / 16;
                const size_t group_bytes = block_count * infer::detail::row_group_block_bytes(dtype);
                std::vector<std::byte> storage(groups * group_bytes);
                for (size_t g = 0; g < groups; ++g)
                    infer::detail::interleave_row_group(dtype, blocks.data(), N, block_count, g, storage.data() + g * group_bytes);
                infer::Tensor grouped = w;
                grouped.row_groups = storage.data();
                std::vector<float> from_groups(9 * N);
                infer::detail::matmul(pool, x.data(), 9, {{grouped, from_groups.data()}});
                CHECK(from_groups == portable);
            }
        }
        // And the products are those of the decoded weights: within the f32 bound of the quantized activations' dot.
        infer::detail::QuantizedRows xq;
        infer::detail::quantize_activations(x.data(), 9, K, infer::detail::activation_block(dtype), xq);
        std::vector<float> row(K);
        for (int64_t n = 0; n < N; ++n) {
            w.read_row(n, row.data());
            double magnitude = 0, dot = 0;
            for (int64_t k = 0; k < K; ++k) {
                dot += double(row[k]) * double(x[k]);
                magnitude += std::fabs(double(row[k]) * double(x[k]));
            }
            CHECK(std::fabs(portable[n] - dot) < 0.02 * magnitude);  // 8-bit activations: about 1 % of Σ|w·x|
        }
    }
    infer::use_cpu_kernels(chosen);
}

TEST_CASE("integer kernels: every weight product of sequence A matches llama.cpp's own to 1e-5 of its scale") {
    REQUIRE_SHARED_OR_SKIP();
    infer::ThreadPool pool(2);
    for (const std::string type : {"Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "Q4_K_M"}) {
        const auto folder = test::shared_dir() / "fixtures/quant" / type;
        const infer::GgufFile gguf = infer::read_gguf(folder / ("model-" + type + ".gguf"));
        const infer::Json manifest = test::read_json(folder / "manifest.json");
        double worst = 0;
        int products = 0;
        for (const infer::Json& product : manifest.at("matmul_A").as_array()) {
            const std::string weight = product.at("weight").as_string();
            CAPTURE(type);
            CAPTURE(weight);
            const infer::Tensor& w = gguf.tensors.at(weight);
            REQUIRE(infer::detail::has_integer_kernel(w.dtype));
            const std::vector<float> x = test::read_floats(folder / product.at("x_file").as_string());
            const std::vector<float> y = test::read_floats(folder / product.at("y_file").as_string());
            const int M = static_cast<int>(product.at("M").as_number());
            std::vector<float> out(y.size());
            infer::detail::matmul(pool, x.data(), M, {{w, out.data()}});
            double scale = 1, error = 0;
            for (float v : y) scale = std::max(scale, std::fabs(double(v)));
            for (size_t i = 0; i < y.size(); ++i) error = std::max(error, std::fabs(double(out[i]) - double(y[i])));
            CHECK(error <= 1e-5 * scale);
            worst = std::max(worst, error / scale);
            ++products;
            // Batch invariance: each token alone gives the same bits as in the batch of M.
            const size_t N = static_cast<size_t>(w.rows()), K = static_cast<size_t>(w.cols());
            for (int t = 0; t < M; t += 5) {
                std::vector<float> alone(N);
                infer::detail::matmul(pool, x.data() + static_cast<size_t>(t) * K, 1, {{w, alone.data()}});
                CHECK(std::memcmp(alone.data(), out.data() + static_cast<size_t>(t) * N, N * 4) == 0);
            }
        }
        MESSAGE(type << ": " << products << " products, worst |Δ| " << worst << " of max(1, max|y|)");
    }
}

TEST_CASE("integer kernels: Q4_1, Q5_0, Q5_1, Q2_K and Q3_K products are the decoded weights times the 8-bit activations") {
    // No llama.cpp reference exists here for Q5_0, Q5_1, Q2_K and Q3_K: the reference is the definition, in double
    // precision, from the decoder of appendix H and the activations' own blocks (Q4_1 is checked against llama.cpp
    // above).
    REQUIRE_SHARED_OR_SKIP();
    test::TempDir dir("integer-q5");
    infer::ThreadPool pool(2);
    std::mt19937 rng(11);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (const std::string type : {"Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K"}) {
        CAPTURE(type);
        const infer::GgufFile gguf = quantized_copy(dir, type, true);
        const infer::Tensor& w = gguf.tensors.at("blk.0.ffn_down.weight");
        REQUIRE(infer::detail::has_integer_kernel(w.dtype));
        const int T = 3;
        const size_t N = static_cast<size_t>(w.rows()), K = static_cast<size_t>(w.cols());
        std::vector<float> x(T * K);
        for (float& v : x) v = normal(rng);
        std::vector<float> out(T * N);
        infer::detail::matmul(pool, x.data(), T, {{w, out.data()}});
        const int block = infer::detail::activation_block(w.dtype);
        infer::detail::QuantizedRows xq;
        infer::detail::quantize_activations(x.data(), T, K, block, xq);
        const bool with_min = w.dtype == infer::DType::Q4_1 || w.dtype == infer::DType::Q5_1;
        std::vector<float> row(K);
        double worst = 0;
        for (size_t n = 0; n < N; ++n) {
            w.read_row(static_cast<int64_t>(n), row.data());
            for (int t = 0; t < T; ++t) {
                // The minimum multiplies the block's stored sum s (as llama.cpp's Q8_1 does), the rest the 8-bit values.
                double expected = 0, scale = 1;
                if (block == 256)  // the K-quants: Σ w · (d_x · q_x), the activations' sums being exact integers
                    for (size_t i = 0; i < K; ++i)
                        expected += double(row[i]) * double(xq.d[(static_cast<size_t>(t) * K + i) / 256]) *
                                    double(xq.q[static_cast<size_t>(t) * K + i]);
                for (size_t b = 0; block == 32 && b < K / 32; ++b) {
                    const size_t at = static_cast<size_t>(t) * (K / 32) + b;
                    // Σ (w − m) · q_x over the block: (w − m) = d_w · q_w, with m at byte 2 of a Q4_1/Q5_1 block.
                    const std::byte* bytes = w.data + n * static_cast<size_t>(w.bytes() / w.rows()) +
                                             b * static_cast<size_t>(infer::dtype_block(w.dtype).bytes);
                    const double m_block = with_min ? infer::detail::f16_at(bytes + 2) : 0.0;
                    double d_w_q = 0;
                    for (size_t i = 0; i < 32; ++i)
                        d_w_q += (double(row[b * 32 + i]) - m_block) * double(xq.q[static_cast<size_t>(t) * K + b * 32 + i]);
                    expected += d_w_q * xq.d[at] + (with_min ? m_block * xq.s[at] : 0.0);
                }
                for (size_t i = 0; i < K; ++i) scale = std::max(scale, std::fabs(double(row[i]) * double(x[static_cast<size_t>(t) * K + i])));
                worst = std::max(worst, std::fabs(expected - out[static_cast<size_t>(t) * N + n]) / (scale * std::sqrt(double(K))));
            }
        }
        CHECK(worst < 1e-5);
    }
}

TEST_CASE("make-model -o FILE.gguf: a random Llama that loads, runs, tokenizes and quantizes") {
    test::TempDir dir("random-gguf");
    infer::ModelShape shape;
    shape.dim = 256, shape.n_layers = 2, shape.n_heads = 4, shape.n_kv_heads = 2, shape.ffn_dim = 512;
    shape.vocab_size = 300, shape.context_length = 64;
    infer::save_random_model_gguf(dir / "random.gguf", shape, infer::DType::F32, 3);
    const infer::Model model = infer::load_model(dir / "random.gguf");
    CHECK(model.layers.size() == 2);
    CHECK(model.config.vocab_size == 300);
    CHECK(model.layers[1].w_down.shape == std::vector<int64_t>{256, 512});  // blk.1.ffn_down.weight, by its GGUF name
    CHECK(infer::load_tokenizer(dir / "random.gguf").vocab_size() == 300);
    const std::vector<float> logits = prefill_logits(model, {1, 5, 9});
    CHECK(std::all_of(logits.begin(), logits.end(), [](float v) { return std::isfinite(v); }));
    infer::QuantizeOptions options;
    options.type = "Q4_K_M";
    const infer::QuantizeReport report = infer::quantize_gguf(dir / "random.gguf", dir / "q.gguf", options);
    CHECK(report.bytes_out < report.bytes_in / 4);
    const infer::Model quantized = infer::load_model(dir / "q.gguf");
    CHECK(quantized.layers[0].wq.dtype == infer::DType::Q4_K);
    CHECK(prefill_logits(quantized, {1, 5, 9}).size() == logits.size());
}
