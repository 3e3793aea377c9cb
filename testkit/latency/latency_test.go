package latency

import (
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestPercentile(t *testing.T) {
	t.Parallel()
	hundred := make([]int, 100)
	for i := range hundred {
		hundred[i] = 100 - i // 100 … 1, unsorted
	}
	twoHundred := make([]time.Duration, 200)
	for i := range twoHundred {
		twoHundred[i] = time.Duration(i+1) * time.Millisecond
	}
	cases := []struct {
		name string
		got  any
		want any
	}{
		{"no samples", Percentile([]int(nil), 0.5), 0},
		{"one sample, median", Percentile([]int{7}, 0.5), 7},
		{"one sample, max", Percentile([]int{7}, 1), 7},
		{"median of 100", Percentile(hundred, 0.5), 50},
		{"p99 of 100", Percentile(hundred, 0.99), 99},
		{"max of 100", Percentile(hundred, 1), 100},
		{"p0 is the smallest", Percentile(hundred, 0), 1},
		{"p99 of 200 durations", Percentile(twoHundred, 0.99), 198 * time.Millisecond},
		{"median of 4 uint64", Percentile([]uint64{4, 1, 3, 2}, 0.5), uint64(2)},
	}
	for _, tc := range cases {
		require.Equal(t, tc.want, tc.got, tc.name)
	}
	require.Equal(t, 100, hundred[0], "the input is left unsorted")
}

// snap is a value with a Changed channel, as replay.Snapshot.
type snap struct {
	n       int
	changed chan struct{}
}

func (s *snap) Changed() <-chan struct{} { return s.changed }

func TestFollowRecordsEveryPublishedValue(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	cur := &snap{n: 0, changed: make(chan struct{})}
	read := make(chan int, 1) // the follower read value n
	current := func() *snap {
		mu.Lock()
		defer mu.Unlock()
		read <- cur.n
		return cur
	}
	stop := Follow(current)
	for n := range 4 {
		select {
		case got := <-read:
			require.Equal(t, n, got)
		case <-time.After(30 * time.Second):
			t.Fatalf("the follower never read value %d", n)
		}
		if n == 3 {
			break
		}
		mu.Lock()
		old := cur
		cur = &snap{n: n + 1, changed: make(chan struct{})}
		mu.Unlock()
		close(old.changed)
	}
	got := stop()
	ns := make([]int, len(got))
	for i, s := range got {
		ns[i] = s.n
	}
	require.Equal(t, []int{0, 1, 2, 3}, ns, "every value, oldest first")
}
