package feed_test

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/feed"
	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/testkit/pgtest"
)

// pki is a throwaway CA with one server and one client certificate.
type pki struct {
	caPool              *x509.CertPool
	server, client      tls.Certificate
	caFile, certFile    string
	keyFile             string
	caCert              *x509.Certificate
	caKey               *ecdsa.PrivateKey
	clientCertUntrusted tls.Certificate
}

func newPKI(t *testing.T) *pki {
	t.Helper()
	dir := t.TempDir()
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	caTmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "caughtup test CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	require.NoError(t, err)
	caCert, err := x509.ParseCertificate(caDER)
	require.NoError(t, err)
	p := &pki{caPool: x509.NewCertPool(), caCert: caCert, caKey: caKey}
	p.caPool.AddCert(caCert)

	leaf := func(serial int64, cn string, usage x509.ExtKeyUsage, signer *x509.Certificate, signerKey *ecdsa.PrivateKey) (tls.Certificate, []byte, []byte) {
		key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		require.NoError(t, err)
		tmpl := &x509.Certificate{
			SerialNumber: big.NewInt(serial), Subject: pkix.Name{CommonName: cn},
			NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
			KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{usage},
			IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)},
		}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, signer, &key.PublicKey, signerKey)
		require.NoError(t, err)
		keyDER, err := x509.MarshalECPrivateKey(key)
		require.NoError(t, err)
		certPEM := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
		keyPEM := pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER})
		c, err := tls.X509KeyPair(certPEM, keyPEM)
		require.NoError(t, err)
		return c, certPEM, keyPEM
	}
	var certPEM, keyPEM []byte
	p.server, certPEM, keyPEM = leaf(2, "redis", x509.ExtKeyUsageServerAuth, caCert, caKey)
	p.client, _, _ = leaf(3, "router", x509.ExtKeyUsageClientAuth, caCert, caKey)
	p.clientCertUntrusted, _, _ = leaf(4, "stranger", x509.ExtKeyUsageClientAuth, caTmpl, mustKey(t)) // not signed by the CA's key

	p.caFile, p.certFile, p.keyFile = filepath.Join(dir, "ca.pem"), filepath.Join(dir, "redis.pem"), filepath.Join(dir, "redis.key")
	require.NoError(t, os.WriteFile(p.caFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: caDER}), 0o644))
	require.NoError(t, os.WriteFile(p.certFile, certPEM, 0o644))
	require.NoError(t, os.WriteFile(p.keyFile, keyPEM, 0o600))
	return p
}

func mustKey(t *testing.T) *ecdsa.PrivateKey {
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	return k
}

// TestTLS turns TLS on in a real redis-server (CONFIG SET, with client
// certificates required) and runs the feed and the budget over it with
// nothing but go-redis's TLSConfig.
func TestTLS(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	r, err := pgtest.StartRedis(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, r.Close()) })
	p := newPKI(t)

	admin := client(t, &redis.Options{Addr: r.Addr()})
	for _, kv := range [][2]string{{"tls-cert-file", p.certFile}, {"tls-key-file", p.keyFile}, {"tls-ca-cert-file", p.caFile}, {"tls-auth-clients", "yes"}} {
		require.NoError(t, admin.ConfigSet(ctx, kv[0], kv[1]).Err(), "CONFIG SET %s: is redis-server built with TLS?", kv[0])
	}
	var tlsAddr string
	for range 5 { // a free port, taken by redis-server; retried if someone else took it first
		l, err := net.Listen("tcp", "127.0.0.1:0")
		require.NoError(t, err)
		port := l.Addr().(*net.TCPAddr).Port
		require.NoError(t, l.Close())
		if err = admin.ConfigSet(ctx, "tls-port", strconv.Itoa(port)).Err(); err == nil {
			tlsAddr = net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
			break
		}
		t.Logf("CONFIG SET tls-port %d: %v", port, err)
	}
	require.NotEmpty(t, tlsAddr, "redis-server would not listen for TLS")

	tlsOpts := func(cfg *tls.Config) *redis.Options {
		return &redis.Options{Addr: tlsAddr, TLSConfig: cfg, MaxRetries: -1, DialTimeout: 2 * time.Second}
	}
	good := &tls.Config{RootCAs: p.caPool, Certificates: []tls.Certificate{p.client}, MinVersion: tls.VersionTLS12}

	name, k := feedName(t), key(t, "k1")
	ring := feed.Keyring{Keys: []feed.Key{k}}
	s := startSubscriber(t, feed.SubscriberConfig{Client: client(t, tlsOpts(good)), Feed: name, Keys: ring})
	s.waitState(t, feed.StateSubscribed)
	pub, _ := startPublisher(t, feed.SenderConfig{Client: client(t, tlsOpts(good)), Feed: name, Name: "a", Keys: ring})
	publish(t, pub, replica("r1", 9))
	require.Equal(t, position.LSN(9), s.next(t).Replica.Replayed)
	b, err := feed.NewBudget(feed.BudgetConfig{Client: client(t, tlsOpts(good)), Rate: 5, Timeout: 5 * time.Second})
	require.NoError(t, err)
	ok, err := b.Allow(ctx, "main")
	require.NoError(t, err)
	require.True(t, ok)

	// Without the CA the server is not trusted; without a client
	// certificate signed by the CA the server refuses.
	for what, cfg := range map[string]*tls.Config{
		"unknown CA":            {Certificates: []tls.Certificate{p.client}},
		"no client certificate": {RootCAs: p.caPool},
		"foreign client cert":   {RootCAs: p.caPool, Certificates: []tls.Certificate{p.clientCertUntrusted}},
	} {
		require.Error(t, client(t, tlsOpts(cfg)).Ping(ctx).Err(), what)
	}
}
