// Package weakkey is a map keyed by pointers that does not keep its keys
// alive: an entry is dropped once the garbage collector frees its key. The
// map therefore never holds more entries than there are live keys, and the
// caller needs no bookkeeping to bound it.
//
// Keying by the pointer itself, rather than by something derived from the
// object (an address, an id), means a new object never inherits the entry
// of a freed one.
package weakkey

import (
	"runtime"
	"sync"
	"weak"
)

// Map maps live *K to V. The zero Map is empty and ready to use; a Map must
// not be copied after first use. It is safe for concurrent use.
type Map[K, V any] struct {
	mu sync.Mutex
	m  map[weak.Pointer[K]]V
}

// Load returns the value stored for k, if k has one.
func (m *Map[K, V]) Load(k *K) (V, bool) {
	if k == nil {
		var zero V
		return zero, false
	}
	w := weak.Make(k)
	m.mu.Lock()
	v, ok := m.m[w]
	m.mu.Unlock()
	return v, ok
}

// Store sets the value for k (not nil) until k is freed or Delete is
// called.
func (m *Map[K, V]) Store(k *K, v V) {
	w := weak.Make(k)
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.m == nil {
		m.m = make(map[weak.Pointer[K]]V)
	}
	if _, ok := m.m[w]; !ok {
		// The cleanup holds the weak pointer, not k: it must not keep k
		// alive. A cleanup left from an earlier Store and Delete only
		// deletes again.
		runtime.AddCleanup(k, m.forget, w)
	}
	m.m[w] = v
}

// Delete removes k's value.
func (m *Map[K, V]) Delete(k *K) {
	if k != nil {
		m.forget(weak.Make(k))
	}
}

func (m *Map[K, V]) forget(w weak.Pointer[K]) {
	m.mu.Lock()
	delete(m.m, w)
	m.mu.Unlock()
}

// Len returns the number of entries, including those whose keys are
// unreachable but whose cleanups have not run yet.
func (m *Map[K, V]) Len() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.m)
}
