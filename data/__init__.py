"""orthon.data"""
