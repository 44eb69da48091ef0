// Prelude: JSON, 16-bit floats, mapped files, the thread pool.
#include "support.hpp"

TEST_CASE("JSON: values, nesting, escapes and surrogate pairs") {
    infer::Json doc = infer::Json::parse(R"({"a": [1, -2.5e3, true, null], "s": "x\"\\\n\u00e9\ud83d\ude00", "o": {}})");
    const auto& a = doc.at("a").as_array();
    REQUIRE(a.size() == 4);
    CHECK(a[0].as_int() == 1);
    CHECK(a[1].as_number() == -2500.0);
    CHECK(a[2].as_bool());
    CHECK(a[3].is_null());
    CHECK(doc.at("s").as_string() == "x\"\\\n\xC3\xA9\xF0\x9F\x98\x80");
    CHECK(doc.at("o").as_object().empty());
    CHECK(doc.find("missing") == nullptr);
}

TEST_CASE("JSON: malformed input is an error naming the origin and byte offset") {
    std::string message = test::error_of([] { infer::Json::parse("{\"a\": [1, 2,, 3]}", "config.json"); });
    CHECK(message.find("config.json") != std::string::npos);
    CHECK(message.find("byte 12") != std::string::npos);
    CHECK(test::error_of([] { infer::Json::parse("{\"a\": 1} extra"); }).find("unexpected text") != std::string::npos);
    CHECK(test::error_of([] { infer::Json::parse("\"open"); }).find("unterminated") != std::string::npos);
    CHECK(test::error_of([] { infer::Json::parse(std::string(10000, '[')); }).find("too deep") != std::string::npos);
    CHECK(test::error_of([] { infer::Json::parse("{\"a\": 1}").at("b"); }).find("\"b\"") != std::string::npos);
    CHECK(test::error_of([] { infer::Json::parse("[1.5]").as_array()[0].as_int(); }).find("integer") != std::string::npos);
}

TEST_CASE("bf16 and f16 conversions match the IEEE bit patterns") {
    CHECK(infer::bf16_to_f32(0x3F80) == 1.0f);
    CHECK(infer::bf16_to_f32(0xC040) == -3.0f);
    CHECK(infer::f32_to_bf16(1.0f) == 0x3F80);
    CHECK(infer::f32_to_bf16(1.00390625f) == 0x3F80);  // exactly halfway: rounds to even
    CHECK(infer::f32_to_bf16(1.01171875f) == 0x3F82);  // halfway above an odd mantissa: rounds up to even
    CHECK(std::isnan(infer::bf16_to_f32(infer::f32_to_bf16(std::nanf("")))));
    CHECK(infer::f16_to_f32(0x3C00) == 1.0f);
    CHECK(infer::f16_to_f32(0xC000) == -2.0f);
    CHECK(infer::f16_to_f32(0x7BFF) == 65504.0f);
    CHECK(infer::f16_to_f32(0x0001) == std::ldexp(1.0f, -24));  // smallest subnormal
    CHECK(std::isinf(infer::f16_to_f32(0x7C00)));
    for (uint32_t bits = 0; bits < 0x7C00; bits += 7) {  // every finite positive half survives a round trip
        CHECK_MESSAGE(infer::f32_to_f16(infer::f16_to_f32(static_cast<uint16_t>(bits))) == bits, "half bits ", bits);
    }
}

TEST_CASE("f32 to f16 rounds to nearest, ties to even, at every pair of neighbouring halves and past the largest") {
    // Between each finite half and the next (the one after 65504 is 65536, which f16 writes as infinity) the f32
    // midpoint is exact: it goes to the even neighbour, the float just below it down and the float just above it up,
    // subnormals included, and the same with the sign bit for the negated values.
    int wrong = 0;
    uint32_t first_wrong = 0;
    for (uint32_t bits = 0; bits < 0x7C00; ++bits) {
        const float low = infer::f16_to_f32(static_cast<uint16_t>(bits));
        const float high = bits == 0x7BFF ? 65536.0f : infer::f16_to_f32(static_cast<uint16_t>(bits + 1));
        const float middle = (low + high) / 2;
        const uint16_t even = static_cast<uint16_t>(bits % 2 == 0 ? bits : bits + 1);
        const bool right = infer::f32_to_f16(middle) == even && infer::f32_to_f16(-middle) == (even | 0x8000) &&
                           infer::f32_to_f16(std::nextafter(middle, 0.0f)) == bits &&
                           infer::f32_to_f16(std::nextafter(middle, 1e9f)) == bits + 1;
        if (!right && wrong++ == 0) first_wrong = bits;
    }
    CHECK_MESSAGE(wrong == 0, wrong, " pairs round wrongly, the first above half bits ", first_wrong);
    CHECK(infer::f32_to_f16(65520.0f) == 0x7C00);
    CHECK(infer::f32_to_f16(-1e30f) == 0xFC00);
    CHECK(infer::f32_to_f16(std::numeric_limits<float>::infinity()) == 0x7C00);
    CHECK(infer::f32_to_f16(-0.0f) == 0x8000);
    CHECK(infer::f32_to_f16(std::ldexp(1.0f, -26)) == 0);  // a quarter of the smallest subnormal
    CHECK(std::isnan(infer::f16_to_f32(infer::f32_to_f16(std::nanf("")))));
}

TEST_CASE("a missing file is an error naming it") {
    std::string message = test::error_of([] { infer::MappedFile("no/such/file.gguf"); });
    CHECK(message.find("no/such/file.gguf") != std::string::npos);
}

TEST_CASE("the thread pool covers every index exactly once, repeatedly") {
    for (int threads : {1, 2, 3, 8}) {
        infer::ThreadPool pool(threads);
        CHECK(pool.size() == threads);
        for (size_t count : {size_t{0}, size_t{1}, size_t{5}, size_t{1000}}) {
            std::vector<std::atomic<int>> hits(count);
            for (int round = 0; round < 20; ++round)
                pool.run(count, [&](size_t begin, size_t end, int thread) {
                    CHECK(thread < threads);
                    for (size_t i = begin; i < end; ++i) hits[i]++;
                });
            for (size_t i = 0; i < count; ++i) CHECK(hits[i] == 20);
        }
    }
}

TEST_CASE("claimed pieces cover every index exactly once, each piece whole, on every thread count") {
    for (int threads : {1, 2, 3, 8}) {
        infer::ThreadPool pool(threads);
        for (size_t count : {size_t{1}, size_t{47}, size_t{48}, size_t{1000}}) {
            std::vector<std::atomic<int>> hits(count);
            std::atomic<int> bad_pieces{0}, bad_threads{0};
            for (int round = 0; round < 20; ++round)
                pool.run_claimed(count, 48, size_t{1} << 20, [&](size_t begin, size_t end, int thread) {
                    if (begin % 48 != 0 || (end - begin != 48 && end != count)) bad_pieces++;
                    if (thread < 0 || thread >= threads) bad_threads++;
                    for (size_t i = begin; i < end; ++i) hits[i]++;
                });
            CHECK(bad_pieces == 0);
            CHECK(bad_threads == 0);
            for (size_t i = 0; i < count; ++i) CHECK(hits[i] == 20);
        }
    }
}

TEST_CASE("JSON strings are written escaped, and invalid UTF-8 never reaches the output raw") {
    std::ostringstream out;
    infer::write_json_string(out, "a\"b\\c\nd\x01");
    CHECK(out.str() == "\"a\\\"b\\\\c\\nd\\u0001\"");
    std::ostringstream bad;
    infer::write_json_string(bad, "ok \xC3(\xFF end");
    CHECK(bad.str() == "\"ok \xEF\xBF\xBD(\xEF\xBF\xBD end\"");
    CHECK(infer::detail::find_invalid_utf8(bad.str()) == std::string_view::npos);
    CHECK(infer::Json::parse(bad.str()).as_string() == "ok \xEF\xBF\xBD(\xEF\xBF\xBD end");
}
