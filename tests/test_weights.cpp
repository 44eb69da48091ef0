// Loading: the three formats, what the configs say, sharded safetensors, and every kind of bad file.
#include "support.hpp"
#include <sys/stat.h>

namespace {

infer::ModelShape tiny_shape() {
    return infer::ModelShape{.dim = 16, .n_layers = 1, .n_heads = 2, .n_kv_heads = 1, .ffn_dim = 32, .vocab_size = 32, .context_length = 64};
}

// A small valid Hugging Face folder, and the good bytes of one of its files, to break in different ways.
struct TinyModel {
    test::TempDir dir;
    std::filesystem::path folder, file;
    std::string good;
    TinyModel(const std::string& name, const std::string& file_name) : dir(name), folder(dir / "model"), file(folder / file_name) {
        infer::save_random_model(folder, tiny_shape(), infer::DType::F32, 1);
        good = infer::read_text_file(file);
    }
};

std::string load_error(const std::filesystem::path& path) {
    return test::error_of([&] { infer::load_model(path); });
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// A GGUF v3 file with no metadata and one tensor of the given type.
std::string gguf_with_tensor_type(uint32_t type) {
    std::string bytes = "GGUF";
    auto put = [&](auto value) { bytes.append(reinterpret_cast<const char*>(&value), sizeof value); };
    put(uint32_t{3});
    put(uint64_t{1});  // tensors
    put(uint64_t{0});  // metadata
    std::string name = "token_embd.weight";
    put(uint64_t{name.size()});
    bytes += name;
    put(uint32_t{2});
    put(uint64_t{32});
    put(uint64_t{4});
    put(type);
    put(uint64_t{0});
    bytes.resize(bytes.size() + 4096, '\0');
    return bytes;
}

}  // namespace

TEST_CASE("configs: derived head_dim, qwen2 biases, llama3 RoPE scaling, mistral MQA, qwen3 head_dim") {
    REQUIRE_SHARED_OR_SKIP();
    auto arch = test::shared_dir() / "fixtures/arch";
    infer::Model llama = infer::load_model(arch / "llama");
    CHECK(llama.config.head_dim == 16);
    CHECK(llama.config.rope_style == infer::RopeStyle::HalfRotation);
    CHECK(!llama.config.tied_embeddings);
    infer::Model qwen2 = infer::load_model(arch / "qwen2");
    CHECK(qwen2.config.qkv_bias);
    CHECK(qwen2.config.tied_embeddings);
    CHECK(qwen2.config.sliding_window == 0);  // use_sliding_window is false
    CHECK(infer::load_model(arch / "llama3").config.rope_scaling.kind == infer::RopeScaling::Kind::Llama3);
    CHECK(infer::load_model(arch / "mistral").config.n_kv_heads == 1);
    infer::Model qwen3 = infer::load_model(arch / "qwen3" / "model.gguf");
    CHECK(qwen3.config.head_dim == 32);
    CHECK(qwen3.config.qk_norm);
    CHECK(qwen3.config.rope_style == infer::RopeStyle::HalfRotation);
    infer::Model llama_gguf = infer::load_model(arch / "llama3" / "model.gguf");
    CHECK(llama_gguf.config.rope_style == infer::RopeStyle::AdjacentPairs);
    CHECK(llama_gguf.rope_freq_divisors.size() == 8);
}

TEST_CASE("stories260K: GGUF and llama2.c files describe the same model with the same numbers") {
    REQUIRE_SHARED_OR_SKIP();
    auto dir = test::shared_dir() / "models/stories260K";
    infer::Model gguf = infer::load_model(dir / "stories260K.gguf");
    infer::Model bin = infer::load_model(dir / "stories260K.bin", dir / "tok512.bin");
    for (const infer::Model* m : {&gguf, &bin}) {
        CHECK(m->config.dim == 64);
        CHECK(m->config.n_layers == 5);
        CHECK(m->config.n_heads == 8);
        CHECK(m->config.n_kv_heads == 4);
        CHECK(m->config.ffn_dim == 172);
        CHECK(m->config.vocab_size == 512);
        CHECK(m->vocab.pieces.size() == 512);
    }
    CHECK(gguf.vocab.pieces == bin.vocab.pieces);
    CHECK(gguf.vocab.scores == bin.vocab.scores);
    CHECK(std::memcmp(gguf.layers[4].w_down.data, bin.layers[4].w_down.data, gguf.layers[4].w_down.bytes()) == 0);
    CHECK(bin.config.tied_embeddings);
    CHECK(bin.config.context_length == 512);
}

TEST_CASE("a file read into memory holds the bytes the mapping shows, from a 2 MB boundary") {
    REQUIRE_SHARED_OR_SKIP();
    const auto path = test::shared_dir() / "models/stories260K/stories260K.gguf";
    infer::MappedFile mapped(path, infer::FileAccess::Map), read(path, infer::FileAccess::Read);
    REQUIRE(read.size() == mapped.size());
    CHECK(read.size() > 0);
    CHECK(std::memcmp(read.data(), mapped.data(), read.size()) == 0);
    CHECK(reinterpret_cast<uintptr_t>(read.data()) % (uintptr_t{2} << 20) == 0);
    infer::Model model = infer::load_model(path, {}, infer::FileAccess::Read);
    CHECK(model.config.n_layers == 5);
}

TEST_CASE("sharded safetensors with an index load like a single file") {
    test::TempDir dir("shards");
    infer::ModelShape shape = tiny_shape();
    std::vector<infer::TensorData> tensors = infer::random_weights(shape, infer::DType::BF16, 3);
    infer::save_random_model(dir / "single", shape, infer::DType::BF16, 3);
    std::filesystem::create_directories(dir / "sharded");
    std::filesystem::copy_file(dir / "single" / "config.json", dir / "sharded" / "config.json");
    size_t half = tensors.size() / 2;
    infer::save_safetensors(dir / "sharded" / "model-00001-of-00002.safetensors", {tensors.begin(), tensors.begin() + half});
    infer::save_safetensors(dir / "sharded" / "model-00002-of-00002.safetensors", {tensors.begin() + half, tensors.end()});
    std::string index = "{\"metadata\": {}, \"weight_map\": {";
    for (size_t i = 0; i < tensors.size(); ++i)
        index += (i ? "," : "") + std::string("\"") + tensors[i].name + "\": \"model-0000" + (i < half ? "1" : "2") + "-of-00002.safetensors\"";
    test::write_file(dir / "sharded" / "model.safetensors.index.json", index + "}}");

    infer::Model single = infer::load_model(dir / "single");
    infer::Model sharded = infer::load_model(dir / "sharded");
    CHECK(sharded.files.size() == 2);
    infer::ThreadPool pool(1);
    infer::SamplingParams params;
    params.temperature = 0;
    params.max_tokens = 8;
    params.ignore_eos = true;
    CHECK(infer::generate_from_ids(single, pool, {1, 5, 9}, params).generated_ids ==
          infer::generate_from_ids(sharded, pool, {1, 5, 9}, params).generated_ids);
}

TEST_CASE("bad safetensors files: truncated, header past the end, missing tensor, wrong shape, unsupported dtype") {
    TinyModel tiny("bad-safetensors", "model.safetensors");
    const std::filesystem::path& folder = tiny.folder;
    const std::filesystem::path& weights = tiny.file;
    const std::string& good = tiny.good;

    test::write_file(weights, good.substr(0, good.size() / 2));
    std::string message = load_error(folder);
    CHECK(contains(message, weights.string()));
    CHECK(contains(message, "run past the end of the file"));

    test::write_file(weights, good.substr(0, 4));
    CHECK(contains(load_error(folder), "truncated safetensors"));

    std::string huge_header = good;
    huge_header[6] = '\x7F';  // header length ≈ 2^55
    test::write_file(weights, huge_header);
    message = load_error(folder);
    CHECK(contains(message, weights.string()));
    CHECK(contains(message, "header length"));
    CHECK(contains(message, "past the end"));

    std::string bad_json = good;
    bad_json[8] = '[';
    test::write_file(weights, bad_json);
    CHECK(contains(load_error(folder), "invalid JSON"));

    std::vector<infer::TensorData> tensors = infer::random_weights(tiny_shape(), infer::DType::F32, 1);
    std::vector<infer::TensorData> missing;
    for (const auto& t : tensors)
        if (t.name != "model.layers.0.mlp.up_proj.weight") missing.push_back(t);
    infer::save_safetensors(weights, missing);
    message = load_error(folder);
    CHECK(contains(message, folder.string()));
    CHECK(contains(message, "missing tensor model.layers.0.mlp.up_proj.weight"));

    for (auto& t : tensors)
        if (t.name == "model.layers.0.mlp.up_proj.weight") std::swap(t.shape[0], t.shape[1]);
    infer::save_safetensors(weights, tensors);
    CHECK(contains(load_error(folder), "tensor model.layers.0.mlp.up_proj.weight has shape [16, 32], expected [32, 16]"));

    std::string other_dtype = good;
    other_dtype.replace(other_dtype.find("\"F32\""), 5, "\"I32\"");
    test::write_file(weights, other_dtype);
    message = load_error(folder);
    CHECK(contains(message, weights.string()));
    CHECK(contains(message, "unsupported dtype I32"));
}

TEST_CASE("bad config.json: not JSON, unknown architecture, missing field, unsupported RoPE scaling") {
    TinyModel tiny("bad-config", "config.json");
    // References, not a structured binding: clang before 16 cannot capture those in a lambda.
    const std::filesystem::path& folder = tiny.folder;
    const std::filesystem::path& config = tiny.file;
    const std::string& good = tiny.good;

    test::write_file(config, "{\"model_type\": \"llama\", oops}");
    std::string message = load_error(folder);
    CHECK(contains(message, config.string()));
    CHECK(contains(message, "invalid JSON at byte"));

    // The error of loading the folder with one piece of the good config.json replaced.
    auto error_with = [&](const std::string& piece, const std::string& replacement) {
        std::string edited = good;
        edited.replace(edited.find(piece), piece.size(), replacement);
        test::write_file(config, edited);
        return load_error(folder);
    };
    message = error_with("\"llama\"", "\"gpt_neox\"");
    CHECK(contains(message, "model_type"));
    CHECK(contains(message, "gpt_neox"));
    CHECK(contains(error_with("\"hidden_size\"", "\"hidden_sise\""), "missing field \"hidden_size\""));
    message = error_with("\"rope_theta\"", "\"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4}, \"rope_theta\"");
    CHECK(contains(message, "rope_scaling"));
    CHECK(contains(message, "yarn"));
    CHECK(contains(error_with("\"num_key_value_heads\": 1", "\"num_key_value_heads\": \"one\""),
                   "field \"num_key_value_heads\": expected a number"));
}

TEST_CASE("bad GGUF files: bad magic, an undecodable or unknown tensor type, truncated") {
    test::TempDir dir("bad-gguf");
    test::write_file(dir / "magic.gguf", "GGUX" + std::string(64, '\0'));
    std::string message = load_error(dir / "magic.gguf");
    CHECK(contains(message, (dir / "magic.gguf").string()));
    CHECK(contains(message, "bad magic"));

    test::write_file(dir / "iq.gguf", gguf_with_tensor_type(23));  // IQ4_XS: a type infer does not decode
    message = load_error(dir / "iq.gguf");
    CHECK(contains(message, "tensor token_embd.weight has type IQ4_XS, which is not supported (supported: F32, F16, BF16, Q8_0"));

    test::write_file(dir / "unknown.gguf", gguf_with_tensor_type(99));
    CHECK(contains(load_error(dir / "unknown.gguf"), "type unknown (99)"));

    std::string short_file = gguf_with_tensor_type(0).substr(0, 40);
    test::write_file(dir / "short.gguf", short_file);
    CHECK(contains(load_error(dir / "short.gguf"), "truncated GGUF"));

    if (!test::shared_dir().empty()) {
        std::string real = infer::read_text_file(test::shared_dir() / "models/stories260K/stories260K.gguf");
        test::write_file(dir / "cut.gguf", real.substr(0, real.size() - 1000));
        message = load_error(dir / "cut.gguf");
        CHECK(contains(message, "runs past the end of the file"));
        test::write_file(dir / "cut-metadata.gguf", real.substr(0, 3000));
        CHECK(contains(load_error(dir / "cut-metadata.gguf"), "truncated GGUF"));
    }
}

TEST_CASE("bad llama2.c files: wrong size for the header, header too short") {
    test::TempDir dir("bad-llama2c");
    int32_t header[7] = {64, 172, 5, 8, 4, 512, 512};
    std::string bytes(reinterpret_cast<const char*>(header), sizeof header);
    test::write_file(dir / "model.bin", bytes + std::string(4000, '\0'));
    std::string message = load_error(dir / "model.bin");
    CHECK(contains(message, (dir / "model.bin").string()));
    CHECK(contains(message, "llama2.c file is 4028 bytes but its header"));
    CHECK(contains(message, "needs 1056540"));
    test::write_file(dir / "tiny.bin", "abc");
    CHECK(contains(load_error(dir / "tiny.bin"), "too small for a llama2.c header"));
    int32_t nonsense[7] = {64, 172, 5, 0, 4, 512, 512};
    test::write_file(dir / "zero.bin", std::string(reinterpret_cast<const char*>(nonsense), sizeof nonsense));
    CHECK(contains(load_error(dir / "zero.bin"), "bad llama2.c header"));
}

TEST_CASE("a missing path is an error naming it") {
    CHECK(contains(load_error("no/such/model"), "no/such/model: no such file or folder"));
}

TEST_CASE("footprint: parameters and bytes per token follow from the shape") {
    test::TempDir dir("footprint");
    infer::ModelShape shape = tiny_shape();
    infer::save_random_model(dir / "m", shape, infer::DType::BF16, 5);
    infer::Model model = infer::load_model(dir / "m");
    const int64_t D = 16, F = 32, V = 32, kv = 8;
    const int64_t expected = 2 * V * D + D + (D + D * D + 2 * kv * D + D * D + D + 3 * F * D);
    CHECK(model.parameter_count() == expected);
    CHECK(model.weight_bytes_per_token() == static_cast<size_t>((expected - V * D + D) * 2));
}

TEST_CASE("hostile headers: dimensions that overflow, shards outside the folder, FIFOs, tokenizers given as models") {
    test::TempDir dir("hostile");
    // A GGUF dimension near 2^62 must not wrap the element count past the bounds check.
    std::string huge = gguf_with_tensor_type(0);
    uint64_t big = (uint64_t{1} << 62) + 7;
    std::memcpy(&huge[4 + 4 + 8 + 8 + 8 + 17 + 4], &big, 8);  // the first dimension of token_embd.weight
    test::write_file(dir / "huge.gguf", huge);
    std::string message = load_error(dir / "huge.gguf");
    CHECK(contains(message, "huge.gguf"));
    CHECK(contains(message, "token_embd.weight"));
    uint64_t product_overflows = uint64_t{1} << 40;  // 2^40 × 4: fine alone; the shape's product is checked too
    std::memcpy(&huge[4 + 4 + 8 + 8 + 8 + 17 + 4], &product_overflows, 8);
    std::memcpy(&huge[4 + 4 + 8 + 8 + 8 + 17 + 4 + 8], &product_overflows, 8);
    test::write_file(dir / "product.gguf", huge);
    CHECK(contains(load_error(dir / "product.gguf"), "2^60"));

    // safetensors: a shape whose product overflows.
    TinyModel tiny("hostile-st", "model.safetensors");
    std::string bytes = tiny.good;
    size_t at = bytes.find("[32, 16]");
    REQUIRE(at != std::string::npos);
    bytes.replace(at, 8, "[1125899906842624, 8192]");  // 2^50 × 2^13: each dimension fine, the product 2^63
    uint64_t length;
    std::memcpy(&length, bytes.data(), 8);
    length += 24 - 8;
    std::memcpy(bytes.data(), &length, 8);
    test::write_file(tiny.file, bytes);
    message = load_error(tiny.folder);
    CHECK(contains(message, "model.safetensors"));
    CHECK(contains(message, "2^60"));
    // A zero first makes the count 0, but the other dimensions' product (2^63) must still be refused: multiplied in
    // another order it overflows before the zero is reached (found by the fuzzer).
    bytes.replace(at, 24, "[0, 1125899906842624, 8192]");
    length += 3;
    std::memcpy(bytes.data(), &length, 8);
    test::write_file(tiny.file, bytes);
    CHECK(contains(load_error(tiny.folder), "2^60"));

    // An index whose shard leaves the model folder.
    TinyModel sharded("hostile-index", "model.safetensors");
    std::filesystem::rename(sharded.file, sharded.folder / "part.safetensors");
    test::write_file(sharded.folder / "model.safetensors.index.json",
                     R"({"weight_map": {"model.embed_tokens.weight": "/etc/passwd", "lm_head.weight": "part.safetensors"}})");
    message = load_error(sharded.folder);
    CHECK(contains(message, "/etc/passwd"));
    CHECK(contains(message, "not a file inside the model folder"));
    CHECK(!contains(message, "root"));
    test::write_file(sharded.folder / "model.safetensors.index.json", R"({"weight_map": {"a": "../part.safetensors"}})");
    CHECK(contains(load_error(sharded.folder), "not a file inside the model folder"));

    // A FIFO given as the model is refused at once (opening it would block until a writer came).
    std::filesystem::path fifo = dir / "model.bin";
    REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
    CHECK(contains(load_error(fifo), "not a regular file"));

    // A tokenizer given as the model.
    REQUIRE_SHARED_OR_SKIP();
    message = load_error(test::shared_dir() / "models/stories260K/tok512.bin");
    CHECK(contains(message, "tok512.bin"));
    CHECK(contains(message, "tokenizer"));
    CHECK(contains(load_error(test::shared_dir() / "tokenizers/gpt2/tokenizer.json"), "JSON file is not a model"));
}
