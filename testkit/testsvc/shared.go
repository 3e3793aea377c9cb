package testsvc

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
)

// Shared is the lifecycle of one harness's shared services: each starts
// lazily, at most once per test binary, so that a `go test -run Unit` pays
// nothing for it, and only while the package's TestMain runs the tests
// through Wrap, which closes the services when the tests end. A harness
// keeps one Shared in a package variable; O is its Options, given to Wrap
// and read by the starts.
type Shared[O any] struct {
	pkg string // "pgtest", "kafkatest": names the package in messages

	mu       sync.Mutex
	active   bool // inside the runner of Wrap
	opts     O
	services []func() error // close the services that started, in this order
}

// NewShared returns the lifecycle of the harness named pkg.
func NewShared[O any](pkg string) *Shared[O] {
	return &Shared[O]{pkg: pkg}
}

// Wrap returns a runner whose Run runs m's with opts in force and then
// closes the services that started, returning 1 instead of 0 if one of them
// fails to close. It takes anything with Run, so that harnesses compose
// (kafkatest.Wrap(pgtest.Wrap(m, …), …)) and goleak can run the result.
func (s *Shared[O]) Wrap(m interface{ Run() int }, opts O) interface{ Run() int } {
	return runner[O]{s: s, m: m, opts: opts}
}

type runner[O any] struct {
	s    *Shared[O]
	m    interface{ Run() int }
	opts O
}

func (r runner[O]) Run() int {
	r.s.mu.Lock()
	r.s.active = true
	r.s.opts = r.opts
	r.s.mu.Unlock()
	code := r.m.Run()
	if err := r.s.close(); err != nil {
		fmt.Fprintf(os.Stderr, "%s: closing shared services: %v\n", r.s.pkg, err)
		if code == 0 {
			code = 1
		}
	}
	return code
}

func (s *Shared[O]) close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.active = false
	var errs []error
	for _, c := range s.services {
		errs = append(errs, c())
	}
	return errors.Join(errs...)
}

// Require fails the test unless the package's TestMain runs its tests
// through the harness's Main or Wrap, since nothing else would stop the
// shared services; what names the function that needs them.
func (s *Shared[O]) Require(t testing.TB, what string) {
	t.Helper()
	s.mu.Lock()
	active := s.active
	s.mu.Unlock()
	if !active {
		t.Fatalf("%s: %s needs the package's TestMain to call %s.Main (or %s.Wrap), which stops the shared services when the tests end", s.pkg, what, s.pkg, s.pkg)
	}
}

// Options returns the options given to Wrap.
func (s *Shared[O]) Options() O {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.opts
}

// Service is one shared service of a harness, of type T (*pgtest.Cluster,
// *kafkatest.Broker, …).
type Service[T interface {
	comparable
	Close() error
}] struct {
	mu   *sync.Mutex // the Shared's: Wrap's runner closes under it
	once sync.Once
	v    T
	err  error
}

// NewService adds a service to s. The runner of Wrap closes the services
// that started in the order they were added, whatever the order they
// started in, so that a harness decides it once (e.g. a Kafka Connect
// worker before the broker it writes to).
func NewService[T interface {
	comparable
	Close() error
}, O any](s *Shared[O]) *Service[T] {
	v := &Service[T]{mu: &s.mu}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.services = append(s.services, func() error {
		var none T
		if v.v == none {
			return nil // never started, or its start failed
		}
		return v.v.Close()
	})
	return v
}

// Get returns the service, calling start on first use. What start returns,
// error included, is what every later call gets: a service that could not
// start is not tried again in the same test binary.
func (v *Service[T]) Get(start func() (T, error)) (T, error) {
	v.once.Do(func() {
		x, err := start()
		v.mu.Lock()
		v.v, v.err = x, err
		v.mu.Unlock()
	})
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.v, v.err
}

// SanitizeName turns a test name into a short lower-case name, readable in
// logs and usable unquoted as a PostgreSQL identifier or a Kafka topic,
// group or connector name: prefix, then the letters and digits of s with
// each run of other characters as one '_', cut at about 40 bytes (prefix
// included) and without a trailing '_'. It is not unique (subtests that
// differ only in punctuation, long names): callers append a counter.
func SanitizeName(prefix, s string) string {
	var b strings.Builder
	b.WriteString(prefix)
	underscore := true // none right after the prefix
	for _, r := range strings.ToLower(s) {
		switch {
		case r >= 'a' && r <= 'z', r >= '0' && r <= '9':
			b.WriteRune(r)
			underscore = false
		case !underscore:
			b.WriteByte('_')
			underscore = true
		}
		if b.Len() >= 40 {
			break
		}
	}
	return strings.TrimRight(b.String(), "_")
}
