package weakkey

import (
	"runtime"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

type key struct{ _ [64]byte }

func TestMap(t *testing.T) {
	t.Parallel()
	var m Map[key, int]
	a, b := new(key), new(key)
	_, ok := m.Load(a)
	require.False(t, ok)
	_, ok = m.Load(nil)
	require.False(t, ok)
	m.Store(a, 1)
	m.Store(a, 2) // replaces; one entry
	v, ok := m.Load(a)
	require.True(t, ok)
	require.Equal(t, 2, v)
	_, ok = m.Load(b)
	require.False(t, ok, "another key")
	require.Equal(t, 1, m.Len())
	m.Delete(a)
	m.Delete(nil)
	_, ok = m.Load(a)
	require.False(t, ok)
	require.Zero(t, m.Len())
	runtime.KeepAlive(a)
	runtime.KeepAlive(b)
}

func TestMapForgetsFreedKeys(t *testing.T) {
	t.Parallel()
	var m Map[key, int]
	for i := range 100 {
		m.Store(new(key), i)
	}
	require.Equal(t, 100, m.Len())
	require.Eventually(t, func() bool {
		runtime.GC()
		return m.Len() == 0
	}, 10*time.Second, 10*time.Millisecond, "entries of freed keys were not dropped")
}
