/* OpenMP's pragmas as a macro, OMP(parallel for ...) for `#pragma omp parallel for ...`, that
 * compiles to nothing without OpenMP: native.py builds the kernels without -fopenmp where the
 * compiler lacks it (they then run on one thread), and such a build should not warn about pragmas
 * it ignores (-Wunknown-pragmas). */
#ifndef QKV_PARALLEL_H
#define QKV_PARALLEL_H

#ifdef _OPENMP
#define QKV_PRAGMA_TEXT(...) #__VA_ARGS__
#define OMP(...) _Pragma(QKV_PRAGMA_TEXT(omp __VA_ARGS__))
#else
#define OMP(...)
#endif

#endif
