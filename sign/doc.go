// Package sign holds the keys caughtup signs with and its one signing
// scheme: HMAC-SHA256 under a shared secret, of a domain that names what
// is signed and then the message. The position feed (package feed) signs
// its observations with it, and web/caughtuphttp its session values; each
// under a domain of its own, so that a value signed for one never verifies
// as the other even under one key (give each its own keys all the same: a
// key leaked from one place should not open the other).
//
//	func signAndVerify(msg []byte) (bool, error) {
//		keys, err := sign.ParseKeys(os.Getenv("CAUGHTUP_KEYS")) // "id:base64secret,…", as Key.Export writes
//		if err != nil {
//			return false, err
//		}
//		ring := sign.Keyring{Keys: keys} // the first signs unless Current says
//		s := sign.NewScheme("example/v1")
//		mac := s.Sum(ring.Signer().Secret, msg)
//		return s.Verify(ring.Signer().Secret, msg, mac), nil
//	}
//
// `caughtup feed --generate-key ID` prints a new key. Keys are rotated
// without downtime by adding the new key everywhere, then signing with it
// (Keyring.Current), then dropping the old one.
//
// The package imports only the standard library, so that anything may
// sign without depending on a transport.
package sign
