// 07_hardware — memory-bound or compute-bound? The machine's two ceilings, measured, and where a model's forward
// passes sit under them.
//
//   07_hardware [-m PATH] [--quick] [-t THREADS] [--svg FILE]
//
// Measures the memory bandwidth (a streaming read of a buffer far larger than the caches, tools/measure.hpp) and
// the peak FLOP/s (independent chains of fused multiply-adds on every thread), then times prefill passes of growing
// length and decode passes of growing batch through ForwardPass. Each pass reads every weight once, so its
// arithmetic intensity (FLOPs per byte read) grows with the tokens in it: decode at batch 1 does 2 FLOPs per f32
// weight of 4 bytes, 0.5 FLOP/byte, far left of the ridge where the roofs meet; prefill of 256 tokens sits far to its
// right. --quick (the tests) uses a smaller bandwidth buffer and fewer shapes. Without -m, the built-in demo model.
// Chapter 07 walks through it; `infer bench roofline` is the same measurement as a command.
#include "bench.hpp"
#include "command_line.hpp"
#include "infer.hpp"

#include <cstdio>
#include <iostream>

int main(int argc, char** argv) try {
    CommandLine line(argc, argv, 1, {"-m", "-t", "--svg"}, {"--quick"},
                     "usage: 07_hardware [-m PATH] [--quick] [-t THREADS] [--svg FILE]\n");
    infer::Model model = line.has("-m") ? infer::load_model(line.text("-m")) : infer::demo_model();
    if (!line.has("-m")) std::cerr << "note: no -m given, so this runs the built-in demo model (random weights; the timing is real)\n";
    infer::ThreadPool pool(static_cast<int>(line.integer("-t", 0, 0, 1024)));

    bench::RooflineOptions options;
    if (line.has("--quick")) {
        options.bandwidth_bytes = size_t{128} << 20;
        options.prefill_tokens = {16, 64};
        options.decode_batches = {1, 4, 16};
        options.repeats = 2;
    }
    bench::Roofline roof = bench::measure_roofline(model, pool, options);
    bench::print_roofline(std::cout, roof, model);

    // The one number to remember: the ridge. A pass with fewer FLOPs per byte than this waits on memory; more, on
    // the FMA units. Decode's intensity is about the batch size × 2 / bytes per weight, so the batch that crosses it is:
    const double bytes_per_weight = static_cast<double>(model.weight_bytes_per_token()) / static_cast<double>(model.parameter_count());
    std::printf("\nridge %.1f FLOP/byte: decode turns compute-bound at a batch of about %.0f sequences "
                "(%.1f bytes per weight, 2 FLOPs per weight per token)\n",
                roof.ridge(), roof.ridge() * bytes_per_weight / 2, bytes_per_weight);
    if (line.has("--svg")) {
        bench::write_svg_file(line.text("--svg"), bench::roofline_chart(roof, "roofline of this machine"));
        std::printf("wrote %s\n", line.text("--svg").c_str());
    }
    return 0;
} catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
}
