set -e
cd /work/main
LIBS="-L/usr/lib/x86_64-linux-gnu/hdf5/mpich -Wl,-rpath,/usr/lib/x86_64-linux-gnu/hdf5/mpich -lhdf5 -lopenblas -lpcre2-8 -lpng -ljpeg -lcpp-httplib -lpthread -L/usr/local/cuda/lib64 -Wl,-rpath,/usr/local/cuda/lib64 -lcudart -lcublas -lcublasLt -lnccl"
for v in "$@"; do
  nvcc -std=c++20 -O3 -gencode=arch=compute_90a,code=sm_90a -Iinclude -Isrc --expt-relaxed-constexpr -Xcompiler -fPIC -ccbin g++ -I/usr/include/x86_64-linux-gnu/mpich --no-compress -DQ3VL_CUDA=1 -DQ3_ABL=$v -c src/tensor/cuda/attention_sm90.cu -o /tmp/abl/a$v.o
  mpicxx -std=c++20 -O2 -o /tmp/abl/attn_check_$v build/obj/tools/gpu/attn_check.cu.o /tmp/abl/a$v.o build/libq3vl.a $LIBS
  strip /tmp/abl/attn_check_$v
done
