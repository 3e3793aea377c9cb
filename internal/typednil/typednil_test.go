package typednil_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/internal/typednil"
)

type allower interface{ Allow() bool }

type budget struct{}

func (*budget) Allow() bool { return true }

type fn func() bool

func (f fn) Allow() bool { return f() }

type value struct{}

func (value) Allow() bool { return true }

func TestIs(t *testing.T) {
	t.Parallel()
	var nilBudget *budget
	var nilFn fn
	for _, tc := range []struct {
		name string
		v    allower
		want bool
	}{
		{"nil interface", nil, true},
		{"nil pointer", nilBudget, true},
		{"nil func", nilFn, true},
		{"pointer", &budget{}, false},
		{"func", fn(func() bool { return true }), false},
		{"value type", value{}, false},
	} {
		require.Equal(t, tc.want, typednil.Is(tc.v), tc.name)
	}
	require.True(t, typednil.Is(map[string]int(nil)))
	require.True(t, typednil.Is([]int(nil)))
	require.True(t, typednil.Is((chan int)(nil)))
	require.False(t, typednil.Is(0))
	require.False(t, typednil.Is(""))
}
