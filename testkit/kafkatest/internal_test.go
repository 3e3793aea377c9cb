package kafkatest

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestJavaMajor(t *testing.T) {
	t.Parallel()
	for out, want := range map[string]int{
		`openjdk version "17.0.15" 2025-04-15`:      17,
		`openjdk version "25" 2025-09-16`:           25,
		`java version "1.8.0_392"`:                  8,
		`openjdk version "21-ea" 2023-09-19`:        21,
		"Error: could not find libjava.so\n":        0,
		`openjdk version "11.0.2" 2019-01-15 LTS\n`: 11,
	} {
		require.Equal(t, want, javaMajor(out), out)
	}
}

// TestPomKeyStable: the cache key depends only on the embedded poms.
func TestPomKeyStable(t *testing.T) {
	t.Parallel()
	a, err := pomKey()
	require.NoError(t, err)
	b, err := pomKey()
	require.NoError(t, err)
	require.Equal(t, a, b)
	require.Len(t, a, 16)
	names, err := poms.ReadDir("maven")
	require.NoError(t, err)
	require.GreaterOrEqual(t, len(names), 4, "pom.xml and the kafka, connect, debezium modules")
}

// TestClusterID: 22 characters of URL-safe base64 that StorageTool's
// argument parser cannot mistake for an option.
func TestClusterID(t *testing.T) {
	t.Parallel()
	seen := map[string]bool{}
	for range 2000 {
		id, err := clusterID()
		require.NoError(t, err)
		require.Len(t, id, 22)
		require.NotEqual(t, byte('-'), id[0], id)
		require.False(t, seen[id])
		seen[id] = true
	}
}
