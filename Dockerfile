# infer serve in a CPU image: built with Debian's compiler and libraries, run alone in a slim image.
#   docker build -t infer .
#   docker run -p 8080:8080 -v /path/to/models:/models infer -m /models/model.gguf
#   docker run -p 8080:8080 -v ~/.cache/huggingface:/root/.cache/huggingface infer -hf ORG/NAME-GGUF:Q4_K_M
# (the second pulls the model from the Hugging Face hub into the mounted cache on its first run; HF_TOKEN with -e
# for gated models)
FROM debian:bookworm-slim AS build
RUN apt-get update && apt-get install -y --no-install-recommends g++ meson ninja-build pkg-config python3 \
        libcpp-httplib-dev nlohmann-json3-dev libssl-dev && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# -Dnative=false: the image must run on any x86-64 host, not only on the one that built it (the matmul and
# attention kernels still pick AVX2 or AVX-512 at run time).
RUN meson setup /build -Dcuda=disabled -Dnative=false && meson compile -C /build infer

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends libcpp-httplib0.11 libssl3 ca-certificates \
        && rm -rf /var/lib/apt/lists/*
COPY --from=build /build/infer /usr/local/bin/infer
EXPOSE 8080
ENTRYPOINT ["infer", "serve", "--host", "0.0.0.0", "--port", "8080"]
