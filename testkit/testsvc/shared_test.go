package testsvc_test

import (
	"errors"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/testkit/testsvc"
)

// The names pgtest (prefix "t_") and kafkatest (no prefix) made before
// they shared SanitizeName.
func TestSanitizeName(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ in, pg, kafka string }{
		{"TestNewDatabaseNames", "t_testnewdatabasenames", "testnewdatabasenames"},
		{"TestX/sub_test#01", "t_testx_sub_test_01", "testx_sub_test_01"},
		{"/Weird--Name/", "t_weird_name", "weird_name"},
		{"", "t", ""},
		{"Ünïcode/Größe", "t_n_code_gr_e", "n_code_gr_e"},
		{"TestAVeryLongNameThatGoesOnAndOnBeyondFortyCharacters/and_a_subtest", "t_testaverylongnamethatgoesonandonbeyond", "testaverylongnamethatgoesonandonbeyondfo"},
		{"Test_123__abc", "t_test_123_abc", "test_123_abc"},
	} {
		require.Equal(t, c.pg, testsvc.SanitizeName("t_", c.in), c.in)
		require.Equal(t, c.kafka, testsvc.SanitizeName("", c.in), c.in)
	}
}

type service struct {
	name   string
	closed *[]string
	err    error
}

func (s *service) Close() error {
	*s.closed = append(*s.closed, s.name)
	return s.err
}

type runFunc func() int

func (f runFunc) Run() int { return f() }

// fatalTB records Fatalf instead of ending the test.
type fatalTB struct {
	testing.TB
	fatal string
}

func (f *fatalTB) Helper() {}

func (f *fatalTB) Fatalf(format string, args ...any) { f.fatal = fmt.Sprintf(format, args...) }

func TestSharedLifecycle(t *testing.T) {
	t.Parallel()
	type options struct{ n int }
	s := testsvc.NewShared[options]("harness")
	var closed []string
	first := testsvc.NewService[*service](s)
	second := testsvc.NewService[*service](s)
	testsvc.NewService[*service](s) // never started, so never closed

	outside := &fatalTB{TB: t}
	s.Require(outside, "Shared")
	require.Equal(t, "harness: Shared needs the package's TestMain to call harness.Main (or harness.Wrap), which stops the shared services when the tests end", outside.fatal)

	starts := 0
	code := s.Wrap(runFunc(func() int {
		inside := &fatalTB{TB: t}
		s.Require(inside, "Shared")
		require.Empty(t, inside.fatal)
		require.Equal(t, 7, s.Options().n)
		// Started in the opposite order to the one they are added in.
		for range 2 {
			got, err := second.Get(func() (*service, error) {
				starts++
				return &service{name: "second", closed: &closed}, nil
			})
			require.NoError(t, err)
			require.Equal(t, "second", got.name)
		}
		_, err := first.Get(func() (*service, error) {
			return &service{name: "first", closed: &closed}, nil
		})
		require.NoError(t, err)
		return 0
	}), options{n: 7}).Run()
	require.Equal(t, 0, code)
	require.Equal(t, 1, starts, "started once")
	require.Equal(t, []string{"first", "second"}, closed, "closed in the order added; the one never started is not closed")

	after := &fatalTB{TB: t}
	s.Require(after, "Shared")
	require.NotEmpty(t, after.fatal, "the services are closed once Run returns")
}

// A service that fails to close fails the run; one that failed to start
// is not retried and not closed.
func TestSharedCloseError(t *testing.T) {
	t.Parallel()
	s := testsvc.NewShared[struct{}]("harness")
	var closed []string
	failing := testsvc.NewService[*service](s)
	broken := testsvc.NewService[*service](s)
	run := func(code int) int {
		return s.Wrap(runFunc(func() int {
			_, _ = failing.Get(func() (*service, error) {
				return &service{name: "failing", closed: &closed, err: errors.New("boom")}, nil
			})
			for range 2 {
				_, err := broken.Get(func() (*service, error) {
					if len(closed) > 0 {
						t.Error("a failed start was tried again")
					}
					return nil, errors.New("cannot start")
				})
				require.EqualError(t, err, "cannot start")
			}
			return code
		}), struct{}{}).Run()
	}
	require.Equal(t, 1, run(0), "a close error turns success into failure")
	require.Equal(t, []string{"failing"}, closed)
	require.Equal(t, 3, run(3), "and keeps the tests' own failure code")
}
