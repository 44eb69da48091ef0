// The infer program: its contracts (--ids JSON, raw logits, make-model) and its errors (message, non-zero exit).
#include "support.hpp"

namespace {
bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

std::string ids_json(const infer::Json& reference) {
    auto list = [](const infer::Json& ids) {
        std::string text;
        for (const infer::Json& id : ids.as_array()) {
            if (!text.empty()) text += ',';
            text += std::to_string(id.as_int());
        }
        return text;
    };
    return "{\"prompt_ids\":[" + list(reference.at("prompt_ids")) + "],\"generated_ids\":[" +
           list(reference.at("generated_ids")) + "]}\n";
}
}  // namespace

TEST_CASE("infer generate --temp 0 --ids reproduces every stories260K reference from both files") {
    REQUIRE_SHARED_OR_SKIP();
    auto dir = test::shared_dir() / "models/stories260K";
    for (const char* name : {"empty", "lily_and_ben", "once_upon_a_time", "the_cat"}) {
        infer::Json reference = test::read_json(dir / "public" / (std::string(name) + ".json"));
        for (auto model : {dir / "stories260K.gguf", dir / "stories260K.bin"}) {
            std::vector<std::string> args = {"generate", "-m", model.string(), "-p", reference.at("prompt").as_string(),
                                             "--temp", "0", "-n", "200", "--ids"};
            if (model.extension() == ".bin") args.insert(args.end(), {"--tokenizer", (dir / "tok512.bin").string()});
            test::ProgramRun run = test::run_infer(args);
            CAPTURE(name);
            CAPTURE(model);
            CAPTURE(run.err);
            CHECK(run.exit_code == 0);
            CHECK(run.out == ids_json(reference));
        }
    }
}

TEST_CASE("infer generate streams the text and reports tokens/s and the time of each layer") {
    REQUIRE_SHARED_OR_SKIP();
    auto dir = test::shared_dir() / "models/stories260K";
    test::ProgramRun run = test::run_infer({"generate", "-m", (dir / "stories260K.gguf").string(), "-p", "Once upon a time",
                                            "--temp", "0", "-n", "12", "-t", "2"});
    CHECK(run.exit_code == 0);
    CHECK(run.out == "Once upon a time, there was a little girl named Lily. She\n");
    CHECK(contains(run.err, "prompt: 5 tokens, generated: 12 tokens"));
    CHECK(contains(run.err, "decode:"));
    for (const char* layer : {"load", "tokenize", "prefill", "decode", "sample", "detokenize"}) CHECK(contains(run.err, layer));
}

TEST_CASE("infer generate without -m runs the built-in demo model and says so") {
    test::ProgramRun run = test::run_infer({"generate", "-p", "Hello", "-n", "16", "--seed", "1"});
    CHECK(run.exit_code == 0);
    CHECK(contains(run.err, "built-in demo model"));
    CHECK(contains(run.err, "meaningless"));
    CHECK(contains(run.err, "generated: 16 tokens"));
    CHECK(run.out.rfind("Hello", 0) == 0);
    CHECK(test::run_infer({"generate", "-p", "Hello", "-n", "16", "--seed", "1"}).out == run.out);  // a seed repeats
}

TEST_CASE("infer logits writes [n_tokens x vocab] float32 that match the reference") {
    REQUIRE_SHARED_OR_SKIP();
    auto fixture = test::shared_dir() / "fixtures/arch/mistral";
    test::TempDir dir("logits");
    test::ProgramRun run = test::run_infer({"logits", "-m", fixture.string(), "--tokens", "1,5,70,300,42,511,7,9,100,200,300,400",
                                            "--out", (dir / "out.f32").string()});
    REQUIRE(run.exit_code == 0);
    std::vector<float> ours = test::read_floats(dir / "out.f32");
    std::vector<float> reference = test::read_floats(fixture / "logits_A.f32");
    REQUIRE(ours.size() == 12 * 512);
    float worst = 0;
    for (size_t i = 0; i < ours.size(); ++i) worst = std::max(worst, std::fabs(ours[i] - reference[i]));
    CHECK(worst < 1e-4f);
}

TEST_CASE("infer make-model writes a folder that loads and generates") {
    test::TempDir dir("make-model");
    test::ProgramRun run = test::run_infer({"make-model", "-o", (dir / "m").string(), "--dim", "32", "--layers", "2", "--heads",
                                            "4", "--kv-heads", "2", "--ffn", "64", "--vocab", "100", "--dtype", "bf16"});
    CHECK(run.exit_code == 0);
    infer::Model model = infer::load_model(dir / "m");
    CHECK(model.config.dim == 32);
    CHECK(model.config.n_kv_heads == 2);
    CHECK(model.layers[1].w_up.dtype == infer::DType::BF16);
    run = test::run_infer({"generate", "-m", (dir / "m").string(), "--prompt-ids", "1,2,3", "-n", "5", "--ignore-eos", "--ids"});
    CHECK(run.exit_code == 0);
    CHECK(contains(run.out, "\"prompt_ids\":[1,2,3]"));
}

TEST_CASE("errors: the program prints the message and exits non-zero") {
    test::TempDir dir("cli-errors");
    test::ProgramRun run = test::run_infer({"generate", "-m", (dir / "absent.gguf").string(), "-p", "x"});
    CHECK(run.exit_code == 1);
    CHECK(contains(run.err, "error: " + (dir / "absent.gguf").string() + ": no such file or folder"));

    test::write_file(dir / "bad.gguf", "GGUX" + std::string(60, '\0'));
    run = test::run_infer({"logits", "-m", (dir / "bad.gguf").string(), "--tokens", "1", "--out", (dir / "o").string()});
    CHECK(run.exit_code == 1);
    CHECK(contains(run.err, "bad magic"));

    run = test::run_infer({"generate", "--top-p", "1.5"});
    CHECK(run.exit_code == 1);
    CHECK(contains(run.err, "invalid sampling parameter top_p = 1.5"));

    run = test::run_infer({"generate", "-n", "ten"});
    CHECK(run.exit_code == 1);
    CHECK(contains(run.err, "option -n: \"ten\" is not an integer"));

    run = test::run_infer({"generate", "--bogus"});
    CHECK(run.exit_code == 1);
    CHECK(contains(run.err, "unknown option \"--bogus\""));

    run = test::run_infer({"generate", "-p", "ok \xFF bad"});
    CHECK(run.exit_code == 1);
    CHECK(contains(run.err, "invalid UTF-8 in the input text at byte offset 3"));

    if (!test::shared_dir().empty()) {
        std::string long_prompt;
        for (int i = 0; i < 600; ++i) long_prompt += "the cat ";
        auto stories = test::shared_dir() / "models/stories260K";
        run = test::run_infer({"generate", "-m", (stories / "stories260K.bin").string(), "--tokenizer",
                               (stories / "tok512.bin").string(), "-p", long_prompt});
        CHECK(run.exit_code == 1);
        CHECK(contains(run.err, "but the model's context holds 512"));
        run = test::run_infer({"logits", "-m", (test::shared_dir() / "fixtures/arch/llama").string(), "--tokens", "1,999",
                               "--out", (dir / "o").string()});
        CHECK(run.exit_code == 1);
        CHECK(contains(run.err, "token id 999 is outside the vocabulary (512 tokens)"));
    }
    run = test::run_infer({"frobnicate"});
    CHECK(run.exit_code == 2);
    CHECK(contains(run.err, "unknown command \"frobnicate\""));
}
