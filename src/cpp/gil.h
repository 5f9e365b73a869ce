// The GIL released around C++ work. pybind11::gil_scoped_release takes the GIL back in a
// noexcept destructor; at interpreter shutdown CPython ends a daemon thread that asks for the
// GIL with pthread_exit, whose stack unwinding cannot pass a noexcept frame: std::terminate,
// and the process aborted at exit ("terminate called without an active exception") whenever a
// daemon thread was rendering. This guard lets that unwinding through.
#pragma once

#include <Python.h>

namespace llamaprompt {

class gil_released {
  public:
    gil_released() : state_(PyEval_SaveThread()) {}
    gil_released(const gil_released &) = delete;
    gil_released & operator=(const gil_released &) = delete;
    // may "throw" the thread's forced unwinding (see above); nothing else
    ~gil_released() noexcept(false) { PyEval_RestoreThread(state_); }

  private:
    PyThreadState * state_;
};

}  // namespace llamaprompt
